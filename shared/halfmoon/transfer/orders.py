"""Carrying out the pool index's orders on a transfer node."""

from __future__ import annotations

import logging
from collections.abc import Callable

from halfmoon.core.keys import key_hex
from halfmoon.core.tiers import Tier
from halfmoon.kv.pool_types import Order, OrderKind
from halfmoon.storage.base import StorageError
from halfmoon.storage.node import NodeStore
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.transport import TransferError

log = logging.getLogger(__name__)


async def execute(order: Order, store: NodeStore, client: TransferClient, address_of: Callable[[str], str]) -> bool:
    """Run one order on the node that holds ``order.dst`` (``order.src`` for FREE); returns
    whether it succeeded, which is what the cache-manager's ``order_done`` needs. A failed copy
    leaves the source in place."""
    key, src, dst = order.key, order.src, order.dst
    try:
        if order.kind is OrderKind.FREE:
            await store.delete(key, src.tier)
            return True
        assert dst is not None
        offset = dst.offset if dst.tier is Tier.DRAM else None
        if order.kind is OrderKind.REPLICATE:
            transport = await client.transport(address_of(src.node))
            (data,) = await transport.read([key])
            await store.write(key, data, dst.tier, offset)
        else:
            await store.move(key, src.tier, dst.tier, offset, keep_src=order.kind is OrderKind.PROMOTE)
        return True
    except (StorageError, TransferError, KeyError) as exc:
        log.warning("order %s %s %s failed: %s", order.order_id, order.kind.value, key_hex(key), exc)
        return False
