"""Per-node KVCache block sets with a shared holder index and replica accounting."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from halfmoon.core.prefix_index import PrefixIndex, match_chain
from halfmoon.policy.eviction import EvictionPolicy, Watermarks, make_eviction


class NodeCache(PrefixIndex[Hashable]):
    """One node's cached blocks, evicted by its policy past the high watermark.

    Leased (locked) blocks are never evicted. Every insertion and removal is reported to the
    owning :class:`ClusterCache`, which keeps the cluster-wide holder index.
    """

    def __init__(self, node: str, cluster: ClusterCache, policy: EvictionPolicy[Hashable]) -> None:
        self.node = node
        self.cluster = cluster
        self.policy = policy
        self.leases: Counter[Hashable] = Counter()

    def __len__(self) -> int:
        return len(self.policy)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.policy

    def match(self, keys: Sequence[Hashable]) -> int:
        return match_chain(keys, self.policy.__contains__)

    def lock(self, keys: Sequence[Hashable]) -> None:
        self.leases.update(keys)

    def unlock(self, keys: Sequence[Hashable]) -> None:
        self.leases.subtract(keys)
        for key in keys:
            if self.leases[key] <= 0:
                del self.leases[key]

    def touch(self, keys: Sequence[Hashable], now: float) -> None:
        # Deepest block first: a parent is always at least as recent as its children.
        for pos in range(len(keys) - 1, -1, -1):
            self.policy.on_access(keys[pos], now=now)

    def insert(self, keys: Sequence[Hashable], now: float) -> list[Hashable]:
        """Insert (or refresh) a prefix chain, then evict down to the low watermark.

        The chain itself is never evicted while it is being stored, so a node can exceed its
        capacity by at most one chain until its next store. The chain is touched deepest block
        first so a parent is always at least as recent as its children: recency-ordered policies
        then never strand a cached child behind an evicted parent.
        """
        capacity = self.cluster.capacity
        if capacity == 0:
            return []
        for pos in range(len(keys) - 1, -1, -1):
            key = keys[pos]
            if key in self.policy:
                self.policy.on_access(key, now=now)
                continue
            self.policy.on_insert(key, now=now, chain_position=pos)
            self.cluster.added(self.node, key, now)
        excess = self.cluster.watermarks.excess(len(self.policy), capacity) if capacity is not None else 0
        return self._evict(excess, now, fresh=set(keys)) if excess else []

    def evict(self, n: int, now: float) -> list[Hashable]:
        return self._evict(n, now, fresh=set())

    def _evict(self, n: int, now: float, fresh: set[Hashable]) -> list[Hashable]:
        """Evict up to ``n`` blocks, never a leased one nor one of the chain being stored."""
        victims = self.policy.victims(n, protected=lambda k: k in self.leases or k in fresh)
        for key in victims:
            self.policy.on_remove(key)
            self.cluster.removed(self.node, key, now)
        return victims


class ClusterCache:
    """Every node's :class:`NodeCache` and the index of who holds what.

    ``index`` maps a block key to the set of nodes holding it (the policies' ``BlockIndex``).
    For every key the cache integrates its replica count over time, so hot blocks can be ranked
    like the paper's Figure 11 (cumulative replica count), and it tracks the peak replica count.
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
        self.nodes = {n: NodeCache(n, self, make_eviction(eviction)) for n in node_ids}
        # key -> [replicas now, time of last change, replica-seconds so far, peak replicas]
        self._replicas: dict[Hashable, list[float]] = {}
        self.evictions = 0

    def node(self, node_id: str) -> NodeCache:
        return self.nodes[node_id]

    def added(self, node: str, key: Hashable, now: float) -> None:
        holders = self.index.get(key)
        if holders is None:
            self.index[key] = {node}
        else:
            holders.add(node)
        self._count(key, +1, now)

    def removed(self, node: str, key: Hashable, now: float) -> None:
        holders = self.index[key]
        holders.discard(node)
        if not holders:
            del self.index[key]
        self._count(key, -1, now)
        self.evictions += 1

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

    def replica_ranking(self, now: float) -> list[tuple[Hashable, float, int]]:
        """(key, time-averaged replicas, peak replicas), hottest first by replica-seconds."""
        rows = []
        for key, (count, last, integral, peak) in self._replicas.items():
            rows.append((key, integral + count * (now - last), int(peak)))
        rows.sort(key=lambda r: r[1], reverse=True)
        return [(k, total / now if now > 0 else 0.0, peak) for k, total, peak in rows]
