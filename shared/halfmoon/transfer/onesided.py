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

from halfmoon.storage.base import Buffer
from halfmoon.transfer.direct import DirectTransport, Source
from halfmoon.transfer.local_memory import LocalMemory, address_of, stage_out
from halfmoon.transfer.rdma_plan import Copy
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import (
    BlockHook,
    SegmentRange,
    WriteBatch,
    back_to_back,
    prepare_all,
)


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


class OneSidedTransport(DirectTransport):
    def __init__(self, control: TcpTransport, path: OneSidedPath) -> None:
        super().__init__(control, path.kind, path.segment_size)
        self.path = path

    def pin(self, buf: Buffer) -> None:
        """Register a long-lived buffer (KV cache pages) so reads into it skip the staging copy."""
        self.path.memory.pin(buf)

    async def _move(self, write: bool, ranges: Sequence[SegmentRange], local: Sequence[memoryview]) -> None:
        await asyncio.to_thread(self._transfer, write, ranges, local)

    def _transfer(self, write: bool, ranges: Sequence[SegmentRange], local: Sequence[memoryview]) -> None:
        """Runs in a worker thread: in place where ``local`` is registered, else through staging."""
        memory = self.path.memory
        if all(memory.pinned(v) for v in local):
            self.path.transfer(write, [Copy(address_of(v), r.offset, r.length) for v, r in zip(local, ranges)])
            return
        with memory.lock:
            staging = memory.staging(sum(r.length for r in ranges))
            staged = stage_out(staging, local) if write else back_to_back(staging, [r.length for r in ranges])
            self.path.transfer(write, [Copy(address_of(v), r.offset, r.length) for v, r in zip(staged, ranges)])
            if not write:
                for dst, src in zip(local, staged):
                    dst[:] = src

    async def _land(self, views: Sequence[memoryview | None], sources: Sequence[Source],
                    check: BlockHook | None) -> None:
        ranges, targets = [], []
        for view, source in zip(views, sources):
            if view is None:
                continue
            if isinstance(source, memoryview):
                view[:] = source
            else:
                ranges.append(SegmentRange(*source))
                targets.append(view)
        if ranges:
            self._check_ranges(ranges)  # where the node located them
            await self._move(False, ranges, targets)
        if check is not None:
            for i, view in enumerate(views):
                if view is not None:
                    check(i, view)

    async def _write_dram(self, batch: WriteBatch) -> None:
        prepare_all(batch.prepare, batch.payloads)
        targets = await self._targets(batch)
        await self.write_ranges([SegmentRange(o, s) for o, s in zip(targets, batch.sizes)], batch.payloads)
        await self.commit(batch.keys, batch.sizes, batch.offsets, batch.caps)

    async def close(self) -> None:
        await self.control.close()
        self.path.close()
