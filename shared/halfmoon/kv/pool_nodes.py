"""Per-node bookkeeping of the pool index: capacity, DRAM offsets and eviction order per tier."""

from __future__ import annotations

from halfmoon.kv.pool_types import NodeSpec, Replica, Tier
from halfmoon.policy.eviction import EvictionPolicy, Watermarks, make_eviction
from halfmoon.storage.allocator import ExtentAllocator, OutOfSpace


class NodeLedger:
    """What the cache-manager believes one transfer node holds.

    Contract: ``reserve`` accounts bytes (and, for DRAM, picks or claims a segment offset) and
    returns the replica, or None when the tier is missing, unavailable or full; ``release``
    undoes exactly one ``reserve``. ``track``/``untrack`` keep the tier's eviction policy in
    step with the replicas that are visible (only visible replicas are eviction candidates).
    """

    def __init__(self, spec: NodeSpec, eviction: str, alignment: int) -> None:
        for tier, cap in spec.capacity.items():
            if cap <= 0:
                raise ValueError(f"node {spec.node_id}: capacity of {tier.name} must be positive")
        self.spec = spec
        dram = spec.capacity.get(Tier.DRAM)
        self.alloc = ExtentAllocator(dram, alignment) if dram else None
        self._used = {tier: 0 for tier in spec.capacity if tier is not Tier.DRAM}
        self.blocks = dict.fromkeys(spec.capacity, 0)
        self.policies: dict[Tier, EvictionPolicy[bytes]] = {tier: make_eviction(eviction) for tier in spec.capacity}
        self.available = dict.fromkeys(spec.capacity, True)

    def capacity(self, tier: Tier) -> int:
        if tier is Tier.DRAM:
            return self.alloc.capacity if self.alloc else 0
        return self.spec.capacity.get(tier, 0)

    def used(self, tier: Tier) -> int:
        if tier is Tier.DRAM:
            return self.alloc.used if self.alloc else 0
        return self._used.get(tier, 0)

    def usable(self, tier: Tier) -> bool:
        return tier in self.spec.capacity and self.available[tier]

    def fill(self, tier: Tier) -> float:
        return self.used(tier) / self.capacity(tier) if self.capacity(tier) else 1.0

    def reserve(self, tier: Tier, size: int, offset: int | None = None) -> Replica | None:
        if not self.usable(tier):
            return None
        if tier is Tier.DRAM:
            alloc = self.alloc
            if alloc is None:  # a DRAM tier of no bytes
                return None
            try:
                ext = alloc.allocate(size) if offset is None else alloc.claim(offset, size)
            except (OutOfSpace, ValueError):  # full, or a misaligned offset from an inventory
                return None
            self.blocks[tier] += 1
            return Replica(self.spec.node_id, tier, ext.offset, size)
        if self._used[tier] + size > self.capacity(tier):
            return None
        self._used[tier] += size
        self.blocks[tier] += 1
        return Replica(self.spec.node_id, tier, -1, size)

    def release(self, replica: Replica) -> None:
        if replica.tier is Tier.DRAM:
            assert self.alloc is not None, "a DRAM replica was allocated here"
            self.alloc.free(replica.offset)
        else:
            self._used[replica.tier] -= replica.size
        self.blocks[replica.tier] -= 1

    def track(self, replica: Replica, key: bytes, now: float, chain_position: int) -> None:
        self.policies[replica.tier].on_insert(key, now=now, chain_position=chain_position)

    def untrack(self, replica: Replica, key: bytes) -> None:
        self.policies[replica.tier].on_remove(key)

    def excess(self, tier: Tier, marks: Watermarks) -> int:
        """Bytes to free to get from above the high watermark down to the low one (0 if below)."""
        return marks.excess(self.used(tier), self.capacity(tier)) if self.capacity(tier) else 0

    def headroom(self, tier: Tier, marks: Watermarks) -> int:
        """Bytes that can be added without rising above the low watermark."""
        return int(marks.low * self.capacity(tier)) - self.used(tier)

    def lower_tier(self, tier: Tier, size: int) -> Tier | None:
        """The next configured, available tier below ``tier`` with room for ``size`` bytes."""
        for lower in (t for t in Tier if t > tier):
            if self.usable(lower) and self.used(lower) + size <= self.capacity(lower):
                return lower
        return None
