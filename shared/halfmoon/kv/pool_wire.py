"""Pool index types <-> NATS messages: the only place the two are translated."""

from __future__ import annotations

from collections.abc import Callable

from halfmoon.core.tiers import Tier
from halfmoon.kv.pool_types import Order, OrderKind, PoolStats, Replica
from halfmoon.protocol.pool import PoolOrder, PoolStatsReply, TierStat
from halfmoon.protocol.work import BlockLocation


def order_to_wire(order: Order) -> PoolOrder:
    return PoolOrder(order_id=order.order_id, kind=order.kind.value, key=order.key, src=order.src,
                     dst=order.dst)


def order_from_wire(order: PoolOrder) -> Order:
    return Order(order.order_id, OrderKind(order.kind), order.key, order.src,
                 order.dst)


def executing_node(order: Order) -> str:
    """The node that carries an order out: the destination of a copy, the holder of a FREE."""
    return order.dst.node if order.dst is not None else order.src.node


def location(key: bytes, replica: Replica, address: str, segment: str) -> BlockLocation:
    """Where a reader finds one replica; ``offset`` is the DRAM offset, 0 in lower tiers."""
    return BlockLocation(address=address, offset=max(0, replica.offset), size=replica.size,
                         segment=segment if replica.tier is Tier.DRAM else "", key=key, tier=replica.tier)


def stats_reply(stats: PoolStats, node_of: Callable[[str], str] = str) -> PoolStatsReply:
    return PoolStatsReply(
        blocks=stats.blocks, pending_puts=stats.pending_puts, leases=stats.leases, lookups=stats.lookups,
        hit_blocks=stats.hit_blocks, miss_blocks=stats.miss_blocks, orders_in_flight=stats.orders_in_flight,
        tiers=tuple(TierStat(node=node_of(t.node), tier=t.tier.name, used_bytes=t.used, capacity_bytes=t.capacity,
                             blocks=t.blocks, available=t.available) for t in stats.tiers),
    )
