"""The capabilities the cache-manager signs: in its put_start and lookup answers, on its tiering
orders and for listing a node's inventory. Transfer nodes check them without asking back."""

from __future__ import annotations

import time
from collections import OrderedDict

from halfmoon.core.tiers import Tier
from halfmoon.kv.pool_types import Order, OrderKind, Replica
from halfmoon.kv.pool_wire import executing_node, location, order_to_wire
from halfmoon.protocol.pool import PoolOrder
from halfmoon.protocol.work import BlockLocation
from halfmoon.transfer.capability import ANY, Capability, Right, sign

READ = Right.READ
WRITE = Right.READ | Right.WRITE | Right.DELETE  # a writer hands the location on to its reader (decode)


class Grants:
    """``ttl_s`` bounds every capability: long enough for a queued decode to read its hand-off.

    Read capabilities name only a node and a key, so one is reused for every lookup of that
    block while at least half its lifetime is left: a hot prefix's lookups sign nothing."""

    def __init__(self, grant_key: bytes, ttl_s: float, cached: int = 1 << 16) -> None:
        if ttl_s <= 0 or cached < 1:
            raise ValueError("capability ttl must be > 0 and the cache hold at least one")
        self._key, self.ttl_s = grant_key, ttl_s
        self._reads: OrderedDict[tuple[str, bytes], tuple[bytes, float]] = OrderedDict()
        self._cached = cached

    def _read(self, node: str, key: bytes) -> bytes:
        now = time.time()
        hit = self._reads.get((node, key))
        if hit is not None and hit[1] - now > self.ttl_s / 2:
            self._reads.move_to_end((node, key))
            return hit[0]
        token = self._sign(Right.READ, node, key)
        self._reads[(node, key)] = (token, now + self.ttl_s)
        if len(self._reads) > self._cached:
            self._reads.popitem(last=False)
        return token

    def _sign(self, rights: Right, node: str, key: bytes, replica: Replica | None = None) -> bytes:
        tier = int(replica.tier) if replica is not None else ANY
        offset = replica.offset if replica is not None and replica.tier is Tier.DRAM else ANY
        size = replica.size if replica is not None else ANY
        return sign(self._key, Capability(int(rights), node, key, time.time() + self.ttl_s, tier, offset, size))

    def location(self, key: bytes, replica: Replica, address: str, segment: str, rights: Right) -> BlockLocation:
        """Where to find a replica, with a capability for ``rights`` on exactly that block there."""
        if rights == READ:  # a reader names no place
            return location(key, replica, address, segment, self._read(replica.node, key))
        return location(key, replica, address, segment, self._sign(rights, replica.node, key, replica))

    def order(self, order: Order) -> PoolOrder:
        target = order.dst if order.dst is not None else order.src
        wire = order_to_wire(order)
        source = b""
        if order.kind is OrderKind.REPLICATE:
            source = self._read(order.src.node, order.key)
        return PoolOrder(order_id=wire.order_id, kind=wire.kind, key=wire.key, src=wire.src, dst=wire.dst,
                         capability=self._sign(Right.ORDER, executing_node(order), order.key, target),
                         source_capability=source)

    def inventory(self, node: str) -> bytes:
        return sign(self._key, Capability(int(Right.LIST), node, b"", time.time() + self.ttl_s))
