"""The capabilities the cache-manager signs: in its put_start and lookup answers, on its tiering
orders and for listing a node's inventory. Transfer nodes check them without asking back."""

from __future__ import annotations

import time

from halfmoon.core.tiers import Tier
from halfmoon.kv.pool_types import Order, OrderKind, Replica
from halfmoon.kv.pool_wire import executing_node, location, order_to_wire
from halfmoon.protocol.pool import PoolOrder
from halfmoon.protocol.work import BlockLocation
from halfmoon.transfer.capability import ANY, Capability, Right, sign

READ = Right.READ
WRITE = Right.READ | Right.WRITE | Right.DELETE  # a writer hands the location on to its reader (decode)


class Grants:
    """``ttl_s`` bounds every capability: long enough for a queued decode to read its hand-off."""

    def __init__(self, grant_key: bytes, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError("capability ttl must be > 0")
        self._key, self.ttl_s = grant_key, ttl_s

    def _sign(self, rights: Right, node: str, key: bytes, replica: Replica | None = None) -> bytes:
        tier = int(replica.tier) if replica is not None else ANY
        offset = replica.offset if replica is not None and replica.tier is Tier.DRAM else ANY
        size = replica.size if replica is not None else ANY
        return sign(self._key, Capability(int(rights), node, key, time.time() + self.ttl_s, tier, offset, size))

    def location(self, key: bytes, replica: Replica, address: str, segment: str, rights: Right) -> BlockLocation:
        """Where to find a replica, with a capability for ``rights`` on exactly that block there."""
        bound = replica if rights & Right.WRITE else None  # a reader names no place; a writer only its own
        return location(key, replica, address, segment, self._sign(rights, replica.node, key, bound))

    def order(self, order: Order) -> PoolOrder:
        target = order.dst if order.dst is not None else order.src
        wire = order_to_wire(order)
        source = b""
        if order.kind is OrderKind.REPLICATE:
            source = self._sign(Right.READ, order.src.node, order.key)
        return PoolOrder(order_id=wire.order_id, kind=wire.kind, key=wire.key, src=wire.src, dst=wire.dst,
                         capability=self._sign(Right.ORDER, executing_node(order), order.key, target),
                         source_capability=source)

    def inventory(self, node: str) -> bytes:
        return sign(self._key, Capability(int(Right.LIST), node, b"", time.time() + self.ttl_s))
