"""The cache-manager's metadata core: block index, placement, leases, tiering. Pure, no I/O.

Protocol (after Mooncake Store): ``put_start`` reserves replica locations, the writer moves the
bytes to the transfer nodes itself, ``put_end`` makes the blocks visible; puts that never end
are revoked by ``expire``. ``lookup`` returns the longest visible prefix of a key chain with
replica locations and a lease; leased blocks are never eviction victims. ``plan`` turns the
state into orders for transfer nodes (demotion under watermark pressure, promotion of blocks
hit in a lower tier, extra DRAM replicas for hot blocks); ``order_done`` applies their outcome.
FREE orders need no answer. ``now`` is any monotonic clock in seconds (simulated time works).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from halfmoon.core.keys import key_hex
from halfmoon.core.prefix_index import PrefixMatcher, match_chain
from halfmoon.kv.pool_nodes import NodeLedger
from halfmoon.kv.pool_state import Block, PoolState
from halfmoon.kv.pool_tiering import Tiering
from halfmoon.kv.pool_types import (
    InventoryItem,
    Lease,
    LookupResult,
    NodeSpec,
    Order,
    Placement,
    PoolConfig,
    PoolStats,
    Replica,
    Tier,
    TierStats,
    UnknownNode,
    UnknownPut,
)  # fmt: skip


@dataclass(slots=True)
class _Lease:
    keys: list[bytes]
    expires_at: float


class PoolIndex(PrefixMatcher[bytes]):
    """The cache-manager's index of the whole pool. Pure: the service feeds it and carries out its orders.

    ``match`` is the read side of the one prefix-index interface; locking is the lookup's lease,
    insertion the two-phase put_start/put_end and eviction the tiering plan, because each of them
    carries replica placements, lease ids or orders for transfer nodes that an in-process cache
    interface cannot.
    """

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self._st = PoolState(config)
        self._tiering = Tiering(self._st, self._place)
        self._leases: dict[int, _Lease] = {}
        self._counts = {"lookups": 0, "hits": 0, "misses": 0}

    # ---- nodes -------------------------------------------------------------------------
    def add_node(self, spec: NodeSpec) -> None:
        if spec.node_id in self._st.nodes:
            raise ValueError(f"node {spec.node_id!r} is already registered")
        self._st.nodes[spec.node_id] = NodeLedger(spec, self.config.eviction, self.config.dram_alignment)

    def node(self, node_id: str) -> NodeSpec:
        return self._ledger(node_id).spec

    def _ledger(self, node_id: str) -> NodeLedger:
        try:
            return self._st.nodes[node_id]
        except KeyError:
            raise UnknownNode(node_id) from None

    def set_tier_available(self, node_id: str, tier: Tier, available: bool) -> None:
        """Mark a tier (e.g. S3 whose endpoint fails) as (un)usable for new data; shown in stats."""
        ledger = self._ledger(node_id)
        if tier in ledger.available:
            ledger.available[tier] = available

    def remove_node(self, node_id: str, now: float) -> list[bytes]:
        """Forget a node that went away; returns the keys that lost their last replica."""
        self._ledger(node_id)
        self._tiering.cancel_node(node_id, now)
        del self._st.nodes[node_id]
        lost = []
        for key, block in list(self._st.blocks.items()):
            block.replicas = [r for r in block.replicas if r.node != node_id]
            if not block.replicas:
                self._st.forget(key)
                lost.append(key)
        return lost

    def rebuild(self, node_id: str, inventory: Iterable[InventoryItem], now: float) -> list[InventoryItem]:
        """Re-add a node's blocks as visible (restarted cache-manager); returns the items refused
        (duplicates, or DRAM ranges that overlap blocks already accounted)."""
        ledger, refused = self._ledger(node_id), []
        for item in inventory:
            block = self._st.blocks.get(item.key)
            if block is not None and any(r.node == node_id and r.tier == item.tier for r in block.replicas):
                refused.append(item)
                continue
            replica = ledger.reserve(item.tier, item.size, item.offset if item.tier is Tier.DRAM else None)
            if replica is None:
                refused.append(item)
                continue
            if block is None:
                block = self._st.blocks[item.key] = Block([], visible=True, deadline=math.inf, position=0)
            self._st.add_replica(item.key, block, replica, now)
        return refused

    # ---- put ---------------------------------------------------------------------------
    def put_start(
        self, keys: Sequence[bytes], sizes: Sequence[int], now: float, first_position: int = 0, tenant: str = ""
    ) -> list[Placement]:
        """Reserve ``config.replicas`` locations for each new key on distinct nodes, in the fastest
        tier with room; fewer (or none: the block is not cached) when space is short or the
        block would take ``tenant`` over its quota (charged once per block, whatever the replicas)."""
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        for key, size in zip(keys, sizes):
            if not isinstance(key, bytes) or len(key) != 32 or not isinstance(size, int) or size <= 0:
                raise ValueError(f"bad block: keys are 32 bytes and sizes positive ints, got {key!r:.40}, {size!r}")
        out = []
        quota, used = self.config.quota(tenant), self._st.tenant_used
        for i, (key, size) in enumerate(zip(keys, sizes)):
            if key in self._st.blocks:
                out.append(Placement(key, (), exists=True))
                continue
            if quota is not None and used.get(tenant, 0) + size > quota:
                out.append(Placement(key, (), exists=False))
                continue
            replicas = self._place(size, self.config.replicas, set(), tuple(Tier))
            if replicas:
                deadline = now + self.config.put_timeout_s
                self._st.blocks[key] = Block(replicas, visible=False, deadline=deadline, position=first_position + i,
                                             tenant=tenant, charged=size)
                used[tenant] = used.get(tenant, 0) + size
            out.append(Placement(key, tuple(replicas), exists=False))
        return out

    def tenant_usage(self, tenant: str) -> int:
        """Pool bytes charged to ``tenant`` (pending and visible blocks)."""
        return self._st.tenant_used.get(tenant, 0)

    def _place(self, size: int, count: int, exclude: set[str], tiers: Sequence[Tier]) -> list[Replica]:
        chosen: list[Replica] = []
        skip = set(exclude)
        for tier in tiers:
            for ledger in sorted(self._st.nodes.values(), key=lambda n: n.fill(tier)):
                if len(chosen) == count:
                    return chosen
                if ledger.spec.node_id not in skip and (replica := ledger.reserve(tier, size)):
                    chosen.append(replica)
                    skip.add(ledger.spec.node_id)
        return chosen

    def put_end(self, keys: Sequence[bytes], now: float) -> None:
        """Make pending puts visible. Every pending key is committed before ``UnknownPut`` is
        raised for the others (never started, revoked by a timeout, or already ended)."""
        unknown = []
        for key in keys:
            block = self._st.blocks.get(key)
            if block is None or block.visible:
                unknown.append(key)
                continue
            block.visible, block.deadline = True, math.inf
            for replica in block.replicas:
                self._st.nodes[replica.node].track(replica, key, now, block.position)
        if unknown:
            raise UnknownPut(f"{len(unknown)} key(s) not pending: {', '.join(key_hex(k) for k in unknown[:4])}")

    def expire(self, now: float) -> list[Order]:
        """Revoke puts past their deadline and end expired leases; returns FREE orders for the
        revoked reservations (the node discards whatever part of them was written)."""
        for lease_id in [i for i, lease in self._leases.items() if lease.expires_at <= now]:
            self.release(lease_id)
        stale = [k for k, b in self._st.blocks.items() if not b.visible and b.deadline <= now]
        return [order for key in stale for order in self._st.drop_block(key)]

    # ---- lookup and leases -------------------------------------------------------------
    def match(self, keys: Sequence[bytes]) -> int:
        """Leading keys whose blocks are visible (put_end done); no lease, no read recorded."""
        return match_chain(keys, lambda key: (block := self._st.blocks.get(key)) is not None and block.visible)

    def lookup(self, keys: Sequence[bytes], now: float) -> LookupResult:
        """Longest visible prefix of ``keys``, replicas fastest tier first, under one lease."""
        self._counts["lookups"] += 1
        hits: list[tuple[Replica, ...]] = []
        for key in keys[: self.match(keys)]:
            block = self._st.blocks[key]
            hits.append(tuple(sorted(block.replicas, key=lambda r: r.tier)))
            self._record_read(key, block, now)
        self._counts["hits"] += len(hits)
        self._counts["misses"] += len(keys) - len(hits)
        if not hits:
            return LookupResult([], None)
        lease = Lease(self._st.new_id(), now + self.config.lease_ttl_s)
        self._leases[lease.lease_id] = _Lease(list(keys[: len(hits)]), lease.expires_at)
        for key in keys[: len(hits)]:
            self._st.blocks[key].leases += 1
        return LookupResult(hits, lease)

    def locate(self, keys: Sequence[bytes]) -> list[tuple[bytes, Replica]]:
        """The fastest replica of each visible key (no lease, no read accounting); others are skipped."""
        out = []
        for key in keys:
            block = self._st.blocks.get(key)
            if block is not None and block.visible and block.replicas:
                out.append((key, min(block.replicas, key=lambda r: r.tier)))
        return out

    def _record_read(self, key: bytes, block: Block, now: float) -> None:
        cfg = self.config
        block.heat = block.read_rate(now, cfg.hot_window_s) * cfg.hot_window_s + 1.0
        block.heat_at = now
        for replica in block.replicas:
            self._st.nodes[replica.node].policies[replica.tier].on_access(key, now=now)
        if not block.in_dram():
            self._st.want_promote[key] = None
        if block.read_rate(now, cfg.hot_window_s) > cfg.hot_reads_per_s:
            self._st.want_hot[key] = None

    def release(self, lease_id: int) -> bool:
        """End a lease early; False when it is unknown or already expired."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        for key in lease.keys:
            if (block := self._st.blocks.get(key)) is not None:
                block.leases -= 1
        return True

    def remove_replica(self, key: bytes, node_id: str, tier: Tier, offset: int) -> list[Order]:
        """Drop one visible replica (the block with its last one), leased or not; FREE orders for it (none if
        unknown, or still being written: a reader never saw that one)."""
        block = self._st.blocks.get(key)
        if block is None or not block.visible:
            return []
        return [self._st.drop_replica(key, block, r) for r in list(block.replicas)
                if (r.node, r.tier) == (node_id, tier) and (tier is not Tier.DRAM or r.offset == offset)]

    def remove(self, keys: Iterable[bytes]) -> list[Order]:
        """Drop blocks even when leased (an explicit purge); returns FREE orders for their replicas."""
        return [order for key in keys if key in self._st.blocks for order in self._st.drop_block(key)]

    # ---- tiering -----------------------------------------------------------------------
    def plan(self, now: float) -> list[Order]:
        """Promotions, hot-block replicas, then demotions/drops for tiers above their high watermark."""
        return self._tiering.plan(now)

    def order_done(self, order_id: int, ok: bool, now: float) -> list[Order]:
        """Apply the outcome of a DEMOTE/PROMOTE/REPLICATE order; returns FREE orders for leftovers."""
        return self._tiering.finish(order_id, ok, now)

    # ---- introspection -----------------------------------------------------------------
    def stats(self) -> PoolStats:
        tiers = [
            TierStats(n.spec.node_id, t, n.used(t), n.capacity(t), n.blocks[t], n.available[t])
            for n in self._st.nodes.values()
            for t in Tier
            if t in n.spec.capacity
        ]
        visible = sum(b.visible for b in self._st.blocks.values())
        return PoolStats(
            blocks=visible,
            pending_puts=len(self._st.blocks) - visible,
            leases=len(self._leases),
            lookups=self._counts["lookups"],
            hit_blocks=self._counts["hits"],
            miss_blocks=self._counts["misses"],
            orders_in_flight=len(self._tiering.orders),
            tiers=tiers,
        )
