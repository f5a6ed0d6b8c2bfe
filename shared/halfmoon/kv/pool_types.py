"""Value types of the KVCache pool index: nodes, replicas, leases, orders, config and stats."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from halfmoon.core.locations import Replica as Replica  # re-exported with the index's other types
from halfmoon.core.tiers import Tier as Tier  # re-exported: the index speaks the pool's tier names
from halfmoon.policy.eviction import EVICTION_POLICIES, Watermarks


class PoolError(Exception):
    """Base of the pool index's typed errors."""


class UnknownNode(PoolError):
    pass


class UnknownPut(PoolError):
    """put_end for keys that were never started, or were revoked by a timeout."""


class NodeSpec(NamedTuple):
    """A transfer node as the cache-manager knows it."""

    node_id: str
    address: str  # "host:port" of its block server
    segment: str  # name of its DRAM shared-memory segment
    capacity: dict[Tier, int]  # bytes per configured tier; a missing tier is not configured


class Placement(NamedTuple):
    """Answer of put_start for one key: where to write it. ``exists``: already cached or being
    written by another writer, skip it; no replicas and not ``exists``: no room, do not cache it."""

    key: bytes
    replicas: tuple[Replica, ...]
    exists: bool


class Lease(NamedTuple):
    lease_id: int
    expires_at: float


class LookupResult(NamedTuple):
    """The longest visible prefix of a key chain, one tuple of replicas per hit, DRAM first."""

    hits: list[tuple[Replica, ...]]
    lease: Lease | None


class InventoryItem(NamedTuple):
    """One block a transfer node reports holding (for rebuilding the index)."""

    key: bytes
    tier: Tier
    offset: int
    size: int


class OrderKind(enum.Enum):
    DEMOTE = "demote"  # copy src -> dst on the same node, then free src
    PROMOTE = "promote"  # copy a lower-tier replica into DRAM on the same node
    REPLICATE = "replicate"  # copy a replica into DRAM on another node (hot block)
    FREE = "free"  # discard a replica (eviction with no lower tier, revoked put, remove)


class Order(NamedTuple):
    """An instruction for transfer nodes; the index learns the outcome via ``order_done``."""

    order_id: int
    kind: OrderKind
    key: bytes
    src: Replica
    dst: Replica | None


class TierStats(NamedTuple):
    node: str
    tier: Tier
    used: int
    capacity: int
    blocks: int
    available: bool


class PoolStats(NamedTuple):
    blocks: int
    pending_puts: int
    leases: int
    lookups: int
    hit_blocks: int
    miss_blocks: int
    orders_in_flight: int
    tiers: list[TierStats]


@dataclass
class PoolConfig:
    """Tunables of the pool index."""

    eviction: str = "lru"  # a name in halfmoon.policy.eviction.EVICTION_POLICIES
    watermarks: Watermarks = field(default_factory=lambda: Watermarks(high=0.9, low=0.7))
    replicas: int = 1
    put_timeout_s: float = 30.0
    lease_ttl_s: float = 10.0
    hot_reads_per_s: float = 50.0  # above this read rate a block gets more DRAM replicas
    hot_window_s: float = 1.0  # time constant of the read-rate estimate
    max_hot_replicas: int = 3
    dram_alignment: int = 64

    def __post_init__(self) -> None:
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {self.eviction!r}; choose from {sorted(EVICTION_POLICIES)}")
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if min(self.put_timeout_s, self.lease_ttl_s, self.hot_window_s) <= 0:
            raise ValueError("timeouts and windows must be positive")
        if self.hot_reads_per_s <= 0 or self.max_hot_replicas < 1:
            raise ValueError("hot_reads_per_s must be > 0 and max_hot_replicas >= 1")
