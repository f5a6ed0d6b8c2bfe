"""Per-node KVCache block sets with a shared holder index and replica accounting."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from halfmoon.policy.eviction import EvictionPolicy, Watermarks, make_eviction


class ClusterCache:
    """Blocks cached on each node, evicted by the named policy when a node passes capacity.

    ``index`` maps a block key to the set of nodes holding it (the policies' ``BlockIndex``).
    Leased blocks (matched by a queued prefill) are never evicted. For every key the cache
    integrates its replica count over time, so hot blocks can be ranked like the paper's
    Figure 11 (cumulative replica count), and it tracks the peak replica count.
    """

    def __init__(
        self,
        node_ids: Sequence[str],
        capacity_blocks: int | None,
        eviction: str = "lru",
        watermarks: Watermarks = Watermarks(high=1.0, low=0.98),
    ) -> None:
        self.capacity = capacity_blocks
        self.watermarks = watermarks
        self.index: dict[Hashable, set[str]] = {}
        self._policies: dict[str, EvictionPolicy] = {n: make_eviction(eviction) for n in node_ids}
        self._leases: dict[str, Counter[Hashable]] = {n: Counter() for n in node_ids}
        # key -> [replicas now, time of last change, replica-seconds so far, peak replicas]
        self._replicas: dict[Hashable, list[float]] = {}
        self.evictions = 0

    def holds(self, node: str, key: Hashable) -> bool:
        return key in self._policies[node]

    def size(self, node: str) -> int:
        return len(self._policies[node])

    def _count(self, key: Hashable, delta: int, now: float) -> None:
        rec = self._replicas.get(key)
        if rec is None:
            self._replicas[key] = [1.0, now, 0.0, 1.0]
            return
        rec[2] += rec[0] * (now - rec[1])
        rec[0] += delta
        rec[1] = now
        if rec[0] > rec[3]:
            rec[3] = rec[0]

    def store(self, node: str, keys: Sequence[Hashable], now: float) -> None:
        """Insert (or refresh) a prefix chain on ``node``, then evict down to the low watermark.

        The chain itself is never evicted while it is being stored, so a node can exceed its
        capacity by at most one chain until its next store. The chain is touched deepest block first so a parent is always at least as recent as
        its children: recency-ordered policies then never strand a cached child behind an
        evicted parent.
        """
        if self.capacity == 0:
            return
        policy = self._policies[node]
        for pos in range(len(keys) - 1, -1, -1):
            key = keys[pos]
            if key in policy:
                policy.on_access(key, now=now)
                continue
            policy.on_insert(key, now=now, chain_position=pos)
            holders = self.index.get(key)
            if holders is None:
                self.index[key] = {node}
            else:
                holders.add(node)
            self._count(key, +1, now)
        if self.capacity is not None:
            excess = self.watermarks.excess(len(policy), self.capacity)
            if excess:
                self._evict(node, excess, now, fresh=set(keys))

    def touch(self, node: str, keys: Sequence[Hashable], now: float) -> None:
        policy = self._policies[node]
        for pos in range(len(keys) - 1, -1, -1):
            policy.on_access(keys[pos], now=now)

    def _evict(self, node: str, n: int, now: float, fresh: set[Hashable]) -> None:
        """Evict up to ``n`` blocks, never a leased one nor one of the chain being stored."""
        policy = self._policies[node]
        leases = self._leases[node]
        for key in policy.victims(n, protected=lambda k: k in leases or k in fresh):
            policy.on_remove(key)
            holders = self.index[key]
            holders.discard(node)
            if not holders:
                del self.index[key]
            self._count(key, -1, now)
            self.evictions += 1

    def lease(self, node: str, keys: Sequence[Hashable]) -> None:
        self._leases[node].update(keys)

    def release(self, node: str, keys: Sequence[Hashable]) -> None:
        leases = self._leases[node]
        leases.subtract(keys)
        for key in keys:
            if leases[key] <= 0:
                del leases[key]

    def replica_ranking(self, now: float) -> list[tuple[Hashable, float, int]]:
        """(key, time-averaged replicas, peak replicas), hottest first by replica-seconds."""
        rows = []
        for key, (count, last, integral, peak) in self._replicas.items():
            rows.append((key, integral + count * (now - last), int(peak)))
        rows.sort(key=lambda r: r[1], reverse=True)
        return [(k, total / now if now > 0 else 0.0, peak) for k, total, peak in rows]
