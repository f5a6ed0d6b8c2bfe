"""Transports that address the node's DRAM segment directly: RDMA (pyverbs) and Mooncake's engine.

Like the shared-memory path, only control messages cross the node's TCP connection (LOCATE
before a read, RESERVE or the cache-manager's offsets and COMMIT around a write); the bytes
move with one-sided READ/WRITE between registered local memory and the segment, which the
node registered once. Blocks not in DRAM are read over TCP. ``read_ranges``/``write_ranges``
move byte ranges of blocks (one layer of each), so a writer can reserve a block, fill it
layer by layer as prefill produces it, and commit it at the end.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence

from halfmoon.core.tiers import Tier
from halfmoon.storage.allocator import Extent
from halfmoon.storage.base import Buffer
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.framing import MISSING, Op, Request
from halfmoon.transfer.local_memory import LocalMemory, address_of, stage_out
from halfmoon.transfer.rdma_plan import Copy
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import (
    BlockHook,
    SegmentRange,
    TransferError,
    Transport,
    check_all,
    check_batch,
    destination,
    missing_error,
    prepare_all,
)


def _nbytes(view: memoryview | None) -> int:
    return 0 if view is None else view.nbytes


class OneSidedPath(ABC):
    """Moves bytes between registered local memory and one node's registered DRAM segment.

    Contract: ``transfer`` blocks until every copy is done or raises ``TransferError``
    (nothing about partial progress is promised); ``Copy.remote`` is a segment offset;
    ``memory`` registers local buffers with the same device or engine."""

    kind: str
    segment_size: int
    memory: LocalMemory

    @abstractmethod
    def transfer(self, write: bool, copies: Sequence[Copy]) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class OneSidedTransport(Transport):
    ranged = True

    def __init__(self, control: TcpTransport, path: OneSidedPath) -> None:
        self.control = control
        self.path = path
        self._read_bytes = METRICS.transfer_bytes.labels(path.kind, "read")
        self._written_bytes = METRICS.transfer_bytes.labels(path.kind, "write")

    def pin(self, buf: Buffer) -> None:
        """Register a long-lived buffer (KV cache pages) so reads into it skip the staging copy."""
        self.path.memory.pin(buf)

    def _check(self, ranges: Sequence[SegmentRange]) -> None:
        if any(r.offset < 0 or r.length <= 0 or r.offset + r.length > self.path.segment_size for r in ranges):
            raise ValueError("ranges must be non-empty and inside the node's DRAM segment")

    def _move(self, write: bool, ranges: Sequence[SegmentRange], local: Sequence[memoryview]) -> None:
        """Runs in a worker thread: in place where ``local`` is registered, else through staging."""
        memory = self.path.memory
        if all(memory.pinned(v) for v in local):
            self.path.transfer(write, [Copy(address_of(v), r.offset, r.length) for v, r in zip(local, ranges)])
            return
        with memory.lock:
            staging = memory.staging(sum(r.length for r in ranges))
            staged = stage_out(staging, local) if write else self._slices(staging, ranges)
            self.path.transfer(write, [Copy(address_of(v), r.offset, r.length) for v, r in zip(staged, ranges)])
            if not write:
                for dst, src in zip(local, staged):
                    dst[:] = src

    @staticmethod
    def _slices(buf: memoryview, ranges: Sequence[SegmentRange]) -> list[memoryview]:
        out, pos = [], 0
        for r in ranges:
            out.append(buf[pos : pos + r.length])
            pos += r.length
        return out

    async def read_ranges(self, ranges: Sequence[SegmentRange], *, into: memoryview | None = None) -> list[memoryview]:
        """Bytes of the segment, back to back in ``into`` (or a fresh buffer); the caller holds a
        lease or reservation that keeps the ranges valid."""
        self._check(ranges)
        views = self._slices(destination(into, sum(r.length for r in ranges)), ranges)
        await asyncio.to_thread(self._move, False, ranges, views)
        self._read_bytes.inc(sum(r.length for r in ranges))
        return views

    async def write_ranges(self, ranges: Sequence[SegmentRange], payloads: Sequence[Buffer]) -> None:
        """Write into reserved, not yet committed extents (``reserve`` first, ``commit`` after)."""
        self._check(ranges)
        local = [memoryview(p).cast("B") for p in payloads]
        if len(local) != len(ranges) or any(v.nbytes != r.length for v, r in zip(local, ranges)):
            raise ValueError("one payload per range, of the range's length")
        await asyncio.to_thread(self._move, True, ranges, local)
        self._written_bytes.inc(sum(r.length for r in ranges))

    async def locate(self, keys: Sequence[bytes], caps: Sequence[bytes] = ()) -> list[Extent]:
        where = await self.control.request(Request(Op.LOCATE, list(keys), caps=list(caps)))
        if not where.ok or len(where.offsets) != len(keys):
            raise TransferError(f"{self.control.address}: locate refused: {where.error}")
        return [Extent(o, s) for o, s in zip(where.offsets, where.sizes)]

    async def reserve(self, keys: Sequence[bytes], sizes: Sequence[int], caps: Sequence[bytes] = ()) -> list[int]:
        resp = await self.control.request(Request(Op.RESERVE, list(keys), list(sizes), caps=list(caps)))
        if not resp.ok or len(resp.offsets) != len(keys):
            raise TransferError(f"{self.control.address}: reserve refused: {resp.error}")
        return list(resp.offsets)

    async def commit(
        self, keys: Sequence[bytes], sizes: Sequence[int], offsets: Sequence[int] | None = None,
        caps: Sequence[bytes] = (),
    ) -> None:
        """Make written blocks visible; with the cache-manager's ``offsets`` this also claims them."""
        claim = offsets is not None
        req = Request(Op.COMMIT, list(keys), list(sizes) if claim else [], list(offsets or ()), caps=list(caps))
        resp = await self.control.request(req)
        if not resp.ok:
            raise TransferError(f"{self.control.address}: commit refused: {resp.error}")

    async def read(
        self,
        keys: Sequence[bytes],
        *,
        caps: Sequence[bytes] = (),
        missing_ok: bool = False,
        extents: Sequence[Extent] | None = None,
        into: memoryview | None = None,
        check: BlockHook | None = None,
    ) -> list[memoryview | None]:
        if extents is None:
            extents = await self.locate(keys, caps)
        elif len(extents) != len(keys):
            raise ValueError("one extent per key")
        lower = [i for i, e in enumerate(extents) if e.size == MISSING]  # demoted (or absent): over TCP
        fetched: dict[int, memoryview | None] = {}
        if lower:
            lower_caps = [caps[i] for i in lower] if caps else []
            fetched = dict(zip(lower, await self.control.read([keys[i] for i in lower], caps=lower_caps,
                                                              missing_ok=True)))
        sizes = [e.size if i not in fetched else _nbytes(fetched[i]) for i, e in enumerate(extents)]
        out = destination(into, sum(sizes))
        views: list[memoryview | None] = [None] * len(keys)
        ranges, targets, pos = [], [], 0
        for i, size in enumerate(sizes):  # back to back in key order, whichever tier a block comes from
            if size == 0:
                continue
            views[i] = view = out[pos : pos + size]
            pos += size
            if (src := fetched.get(i)) is not None:
                view[:] = src
            else:
                ranges.append(SegmentRange(*extents[i]))
                targets.append(view)
        if ranges:
            self._check(ranges)
            await asyncio.to_thread(self._move, False, ranges, targets)
            self._read_bytes.inc(sum(r.length for r in ranges))
        check_all(check, views)
        if not missing_ok and None in views:
            raise missing_error(keys, views)
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
        if tier is not Tier.DRAM:
            await self.control.write(keys, payloads, caps=caps, offsets=offsets, tier=tier, prepare=prepare)
            return
        sizes = check_batch(keys, payloads, offsets)
        prepare_all(prepare, payloads)
        targets = list(offsets) if offsets is not None else await self.reserve(keys, sizes, caps)
        await self.write_ranges([SegmentRange(o, s) for o, s in zip(targets, sizes)], payloads)
        await self.commit(keys, sizes, offsets, caps)

    async def delete(self, keys: Sequence[bytes], *, caps: Sequence[bytes] = ()) -> int:
        return await self.control.delete(keys, caps=caps)

    async def close(self) -> None:
        await self.control.close()
        self.path.close()
