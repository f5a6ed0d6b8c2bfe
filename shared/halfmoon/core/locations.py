"""Where one copy of a KV block lives: the one location type of the pool."""

from __future__ import annotations

import msgspec

from halfmoon.core.tiers import Tier


class Replica(msgspec.Struct, frozen=True, array_like=True):
    """One copy of a block on a transfer node.

    ``node`` is the transfer node's instance id (never an address: readers resolve it from the
    node's heartbeat); ``offset`` is the byte offset in the node's DRAM segment, -1 on NVMe and S3.
    The pool index keeps these, the cache-manager sends them in orders, unchanged.
    """

    node: str
    tier: Tier
    offset: int
    size: int
