"""The data-plane client contract: batched block reads and writes against one transfer node.

TCP implements it (tcp.py), and so do the transports that address the node's DRAM segment
directly (direct.py: same-host shared memory, one-sided RDMA and Mooncake), which move bytes at
the offsets the control messages report.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Literal, NamedTuple, overload

from halfmoon.core.tiers import Tier
from halfmoon.storage.allocator import Extent
from halfmoon.storage.base import BlockNotFound, Buffer

__all__ = ["BlockHook", "BlockNotFound", "ReadBatch", "SegmentRange", "TransferError", "Transport", "WriteBatch"]

# ``hook(index, bytes)`` for one block of a batch: see ``Transport``'s ``prepare`` and ``check``.
BlockHook = Callable[[int, memoryview], object]


class TransferError(Exception):
    """The node could not be reached or refused the request; nothing is assumed stored."""


class SegmentRange(NamedTuple):
    """``length`` bytes at ``offset`` of the node's DRAM segment (a block, or a layer of one)."""

    offset: int
    length: int


class ReadBatch(NamedTuple):
    """``Transport.read``'s arguments but ``missing_ok``, which ``read`` applies itself."""

    keys: Sequence[bytes]
    caps: Sequence[bytes]
    extents: Sequence[Extent] | None
    into: memoryview | None
    check: BlockHook | None


class WriteBatch(NamedTuple):
    """``Transport.write``'s arguments, validated, with each payload's size."""

    keys: Sequence[bytes]
    payloads: Sequence[Buffer]
    sizes: list[int]
    caps: Sequence[bytes]
    offsets: Sequence[int] | None
    tier: Tier
    prepare: BlockHook | None


class Transport(ABC):
    """Contract: ``read`` returns one view per key, in order, into buffers owned by the caller
    (valid after later calls); a block the node lacks is ``None`` with ``missing_ok`` and raises
    ``BlockNotFound`` (naming every missing key) otherwise. ``write`` stores every block or
    raises ``TransferError`` naming the keys that failed (the others are stored). ``offsets``
    are DRAM segment offsets chosen by the cache-manager; without them the node chooses.
    Connection failures raise ``TransferError``. ``into`` is a writable buffer to receive the
    blocks back to back (e.g. KV cache pages); the views are then slices of it, and a buffer
    too small for the blocks is a ``ValueError``. ``extents`` are the DRAM (offset, size) of
    each key from a lookup's replicas (the lease keeps them valid); transports that address the
    segment directly (shared memory, RDMA) then skip asking the node, others ignore them.
    ``caps`` are one capability per key (transfer/capability.py), from the cache-manager's
    answers or a park capability; the node refuses keys they do not cover.

    ``prepare(i, payload)`` runs on each payload just before its bytes leave and may rewrite them
    in place (the writer seals each block there); ``check(i, view)`` runs on each block read as
    soon as its bytes have landed in the caller's buffer, while later blocks are still in flight
    (the reader verifies each block there). Why per block: over TCP the node keeps moving the
    neighbouring block through the socket meanwhile (the MAC overlaps the transfer across the two
    processes), and the MAC reads bytes the move just touched. Transports that move a batch at
    once call them all before (``prepare``) or after (``check``) it; either may run again for a
    block on a retry. A hook that raises fails the call.

    Implementations provide ``_read``/``_write``: ``write`` validates a batch before anything moves,
    ``read`` turns missing blocks into ``BlockNotFound``."""

    @overload
    async def read(
        self,
        keys: Sequence[bytes],
        *,
        caps: Sequence[bytes] = (),
        missing_ok: Literal[False] = False,
        extents: Sequence[Extent] | None = None,
        into: memoryview | None = None,
        check: BlockHook | None = None,
    ) -> list[memoryview]: ...

    @overload
    async def read(
        self,
        keys: Sequence[bytes],
        *,
        caps: Sequence[bytes] = (),
        missing_ok: bool,
        extents: Sequence[Extent] | None = None,
        into: memoryview | None = None,
        check: BlockHook | None = None,
    ) -> list[memoryview | None]: ...

    async def read(
        self,
        keys: Sequence[bytes],
        *,
        caps: Sequence[bytes] = (),
        missing_ok: bool = False,
        extents: Sequence[Extent] | None = None,
        into: memoryview | None = None,
        check: BlockHook | None = None,
    ) -> list[memoryview] | list[memoryview | None]:
        views = await self._read(ReadBatch(keys, caps, extents, into, check))
        if not missing_ok and None in views:
            raise BlockNotFound([k for k, v in zip(keys, views) if v is None])
        return views

    async def write(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[Buffer],
        *,
        caps: Sequence[bytes] = (),
        offsets: Sequence[int] | None = None,
        tier: Tier = Tier.DRAM,
        prepare: BlockHook | None = None,
    ) -> None:
        sizes = check_batch(keys, payloads, offsets)
        await self._write(WriteBatch(keys, payloads, sizes, caps, offsets, tier, prepare))

    @abstractmethod
    async def _read(self, batch: ReadBatch) -> list[memoryview | None]:
        """One view per key, ``None`` for a block the node lacks (``read`` decides whether that is an error)."""

    @abstractmethod
    async def _write(self, batch: WriteBatch) -> None:
        """Store a batch ``write`` has validated."""

    ranged = False
    """Whether ``write_ranges``/``read_ranges``/``commit`` work: the transport addresses the node's DRAM
    segment directly (shared memory, one-sided RDMA), so a writer can fill a block the cache-manager
    placed piece by piece (layer by layer), a reader can read those pieces before the block is
    committed, and ``commit`` makes it visible. Others move whole blocks only."""

    async def write_ranges(self, ranges: Sequence[SegmentRange], payloads: Sequence[Buffer]) -> None:
        raise TransferError("this transport moves whole blocks only")

    async def read_ranges(self, ranges: Sequence[SegmentRange], *, into: memoryview | None = None) -> list[memoryview]:
        raise TransferError("this transport moves whole blocks only")

    async def commit(self, keys: Sequence[bytes], sizes: Sequence[int], offsets: Sequence[int] | None = None,
                     caps: Sequence[bytes] = ()) -> None:
        raise TransferError("this transport moves whole blocks only")

    @abstractmethod
    async def delete(self, keys: Sequence[bytes], *, caps: Sequence[bytes] = ()) -> int:
        """Remove the keys from every tier of the node; returns how many it held."""

    @abstractmethod
    async def close(self) -> None: ...


def destination(into: memoryview | None, nbytes: int) -> memoryview:
    """Where a read lands: the caller's buffer, or a fresh one."""
    if into is None:
        return memoryview(bytearray(nbytes))
    into = into.cast("B") if into.format != "B" or into.ndim != 1 else into
    if into.readonly or into.nbytes < nbytes:
        raise ValueError(f"read destination must be writable and hold {nbytes} bytes, got {into.nbytes}")
    return into[:nbytes]


def back_to_back(buf: memoryview, sizes: Sequence[int]) -> list[memoryview]:
    """Consecutive slices of ``buf`` from its start, one per size."""
    return [buf[end - size : end] for size, end in zip(sizes, accumulate(sizes))]


def block_views(into: memoryview | None, sizes: Sequence[int]) -> tuple[memoryview, list[memoryview | None]]:
    """Where a read's blocks land: back to back in key order in its ``destination``, returned with
    one view per block, ``None`` where the size is 0 or negative (missing; NOTE: blocks are never empty)."""
    present = [size if size > 0 else 0 for size in sizes]
    buf = destination(into, sum(present))
    return buf, [buf[end - size : end] if size else None for size, end in zip(present, accumulate(present))]


def check_batch(keys: Sequence[bytes], payloads: Sequence[Buffer], offsets: Sequence[int] | None) -> list[int]:
    """Validate a write batch before anything is sent; returns the payload sizes."""
    if len(keys) != len(payloads) or (offsets is not None and len(offsets) != len(keys)):
        raise ValueError("keys, payloads and offsets must have the same length")
    if any(not isinstance(k, bytes) or len(k) != 32 for k in keys):
        raise ValueError("block keys are 32 bytes")
    sizes = [memoryview(p).nbytes for p in payloads]
    if any(s == 0 for s in sizes):
        raise ValueError("empty blocks cannot be stored")
    return sizes


def prepare_all(prepare: BlockHook | None, payloads: Sequence[Buffer]) -> None:
    """``prepare`` on every payload, for transports that send a batch at once."""
    if prepare is not None:
        for i, payload in enumerate(payloads):
            prepare(i, memoryview(payload).cast("B"))
