"""Same-host transport: bytes move through the node's shared-memory segment, never a socket.

The segment's name is only told over an authenticated connection, and the segment is private
to the node's user (mode 0600): a weaker boundary than the socket by nature, since a client
that maps it can read and write any byte (the KV MACs still catch what it forges). Only
control messages cross the TCP connection: LOCATE before a read, RESERVE (or nothing, when the
cache-manager already chose the offsets) and COMMIT around a write. Blocks that are not in DRAM
(demoted to NVMe/S3) are read over TCP.
"""

from __future__ import annotations

from collections.abc import Sequence

from halfmoon.storage.segment import AttachedSegment
from halfmoon.transfer.direct import DirectTransport, Source
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import BlockHook, SegmentRange, TransferError, WriteBatch


class ShmTransport(DirectTransport):
    def __init__(self, control: TcpTransport, segment: AttachedSegment) -> None:
        super().__init__(control, "shm", segment.size)
        self._shm = segment
        self._seg = segment.buf

    @property
    def current(self) -> bool:
        """False once the node's segment was replaced (node restart): reopen the transport."""
        return self._shm.is_current()

    def _check_attached(self) -> None:
        if not self._shm.is_current():
            raise TransferError(f"{self.control.address}: segment {self._shm.name} is gone (node restarted?)")

    async def _move(self, write: bool, ranges: Sequence[SegmentRange], local: Sequence[memoryview]) -> None:
        for r, view in zip(ranges, local):
            if write:
                self._seg[r.offset : r.offset + r.length] = view
            else:
                view[:] = self._seg[r.offset : r.offset + r.length]

    async def _land(self, views: Sequence[memoryview | None], sources: Sequence[Source],
                    check: BlockHook | None) -> None:
        for i, view in enumerate(views):
            if view is None:
                continue
            source = sources[i]
            if isinstance(source, memoryview):
                view[:] = source
            else:
                offset, size = source
                # NOTE: the segment view is a temporary: a raised hook's traceback keeps this frame, and no
                # segment view may outlive the call
                view[:] = self._seg[offset : offset + size]
            if check is not None:  # NOTE: on the private copy: any same-host client can write the segment
                check(i, view)

    async def _write_dram(self, batch: WriteBatch) -> None:
        targets = await self._targets(batch)
        self._check_ranges(zip(targets, batch.sizes))
        for i, (offset, size, payload) in enumerate(zip(targets, batch.sizes, batch.payloads)):
            src = memoryview(payload).cast("B")
            if batch.prepare is not None:  # right before its copy, which then reads it from cache
                batch.prepare(i, src)
            self._seg[offset : offset + size] = src
        # with the cache-manager's offsets, COMMIT carries the extents and claims them in one step
        await self.commit(batch.keys, batch.sizes, batch.offsets, batch.caps)
        self._written_bytes.inc(sum(batch.sizes))

    async def close(self) -> None:
        await self.control.close()
        self._seg.release()
        self._shm.close()
