"""Pool housekeeping messages: tiering orders for transfer nodes, pool stats, explicit removal."""

from __future__ import annotations

import msgspec

from halfmoon.core.locations import Replica
from halfmoon.protocol.base import Message


class PoolOrder(msgspec.Struct, frozen=True, kw_only=True):
    """``kind`` is demote, promote, replicate or free (see halfmoon.kv.pool_types.OrderKind)."""

    order_id: int
    kind: str
    key: bytes
    src: Replica
    dst: Replica | None = None
    capability: bytes = b""  # the cache-manager's ORDER capability for the executing node
    source_capability: bytes = b""  # replicate: a READ capability on the source node


class OrderBatch(Message, frozen=True, kw_only=True, tag="order_batch"):
    """Orders for the receiving transfer node; ``addresses`` maps node ids to ``host:port``
    so replication can read from a peer."""

    orders: tuple[PoolOrder, ...]
    addresses: dict[str, str] = msgspec.field(default_factory=dict)


class OrderResults(Message, frozen=True, kw_only=True, tag="order_results"):
    """One success flag per order, in order; ``unavailable_tiers`` the node cannot reach now."""

    ok: tuple[bool, ...]
    unavailable_tiers: tuple[int, ...] = ()


class StatsRequest(Message, frozen=True, kw_only=True, tag="stats_request"):
    pass


class TierStat(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    tier: str
    used_bytes: int
    capacity_bytes: int
    blocks: int
    available: bool


class PoolStatsReply(Message, frozen=True, kw_only=True, tag="pool_stats"):
    blocks: int
    pending_puts: int
    leases: int
    lookups: int
    hit_blocks: int
    miss_blocks: int
    orders_in_flight: int
    tiers: tuple[TierStat, ...] = ()


class RemoveRequest(Message, frozen=True, kw_only=True, tag="remove"):
    keys: tuple[bytes, ...]


class KVEvents(Message, frozen=True, kw_only=True, tag="kv_events"):
    """A prefill instance's local prefix cache changed: ``stored`` and ``evicted`` block keys.
    A ``snapshot`` lists every key it holds and replaces what the receiver knew of it. The
    prefill timings measured since the last event ride along, for the conductor's cost model."""

    instance_id: str
    stored: tuple[bytes, ...] = ()
    evicted: tuple[bytes, ...] = ()
    snapshot: bool = False
    # measured (new tokens, cached tokens, seconds): seconds is the request's share of the engine steps that
    # computed it (by tokens), not wall time, which would count the prompts it queued behind too
    prefill_samples: tuple[tuple[int, int, float], ...] = ()


class SnapshotRequest(Message, frozen=True, kw_only=True, tag="kv_snapshot_request"):
    """Ask every prefill instance to publish a snapshot KVEvents (a restarted conductor does)."""
