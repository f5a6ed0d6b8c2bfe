"""Cache-manager messages: the pool protocol (put_start/put_end, lookup/release, reports)."""

from __future__ import annotations

import msgspec

from halfmoon.protocol.base import Message
from halfmoon.protocol.work import BlockLocation


class PutStart(Message, frozen=True, kw_only=True, tag="put_start"):
    """Ask where to write blocks ``keys`` of ``sizes`` bytes; the writer then sends the bytes
    to the transfer nodes itself and confirms with PutEnd. Unconfirmed puts are revoked."""

    writer: str
    keys: tuple[bytes, ...]
    sizes: tuple[int, ...]
    first_position: int = 0  # chain position of keys[0] (length-aware eviction ranks by it)
    tenant: str = ""  # whose pool quota new blocks count against ("": none)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.sizes):
            raise ValueError(f"{len(self.keys)} keys but {len(self.sizes)} sizes")
        if any(s < 1 for s in self.sizes):
            raise ValueError("block sizes must be >= 1")


class PutPlan(Message, frozen=True, kw_only=True, tag="put_plan"):
    """Reply to PutStart: where to write each new block; ``existing`` keys need no write.

    Each placement's ``capability`` lets its holder write, read and delete that block at that
    place until it expires; each of ``existing_replicas``' lets it read. A key over the
    tenant's quota (or without room) has no placement and is not ``existing``: not cached."""

    placements: tuple[BlockLocation, ...]
    existing: tuple[bytes, ...] = ()
    expires: float = 0.0
    existing_replicas: tuple[BlockLocation, ...] = ()  # where each visible ``existing`` key can be read


class PutEnd(Message, frozen=True, kw_only=True, tag="put_end"):
    """The bytes of ``keys`` are written: make them visible to lookups."""

    writer: str
    keys: tuple[bytes, ...]


class Lookup(Message, frozen=True, kw_only=True, tag="lookup"):
    """Longest cached prefix of the chain ``keys``, leased for ``lease_s`` seconds."""

    keys: tuple[bytes, ...]
    lease_s: float = 30.0


class BlockReplicas(msgspec.Struct, frozen=True, kw_only=True):
    key: bytes
    replicas: tuple[BlockLocation, ...]


class LookupResult(Message, frozen=True, kw_only=True, tag="lookup_result"):
    """The matched prefix, in chain order; leased blocks are not evicted before ``lease_expires``.
    Each replica's ``capability`` lets its holder read it."""

    hits: tuple[BlockReplicas, ...]
    lease_id: str | None = None
    lease_expires: float = 0.0


class Release(Message, frozen=True, kw_only=True, tag="release"):
    """Drop a lease early (the reader has its bytes)."""

    lease_id: str


class CorruptBlocks(Message, frozen=True, kw_only=True, tag="corrupt_blocks"):
    """Replicas a reader got from the pool that failed their MAC (damaged bytes, or sealed under another
    key), as the lookup gave them: the cache-manager drops each (the replica, not the key: a block
    written again since is another replica), so the next computation of that prefix writes them again."""

    reporter: str
    blocks: tuple[BlockLocation, ...]


class CacheAck(Message, frozen=True, kw_only=True, tag="cache_ack"):
    """Reply to PutEnd / Release: how many keys or leases it affected."""

    count: int


class TransferReport(Message, frozen=True, kw_only=True, tag="transfer_report"):
    """A transfer node's inventory: a ``full`` snapshot (on start / on request) or a delta."""

    node_id: str
    address: str
    capacity_bytes: int
    used_bytes: int
    added: tuple[BlockLocation, ...] = ()
    removed: tuple[bytes, ...] = ()
    full: bool = False
