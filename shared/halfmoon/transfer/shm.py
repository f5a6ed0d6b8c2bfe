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
from itertools import accumulate

from halfmoon.core.tiers import Tier
from halfmoon.storage.allocator import Extent
from halfmoon.storage.base import Buffer
from halfmoon.storage.segment import AttachedSegment
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.framing import MISSING, Op, Request
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import (
    BlockHook,
    SegmentRange,
    TransferError,
    Transport,
    check_batch,
    destination,
    missing_error,
)

_READ = METRICS.transfer_bytes.labels("shm", "read")
_WRITTEN = METRICS.transfer_bytes.labels("shm", "write")


class ShmTransport(Transport):
    def __init__(self, control: TcpTransport, segment: AttachedSegment) -> None:
        self.control = control
        self._shm = segment
        self._seg = segment.buf

    @property
    def current(self) -> bool:
        """False once the node's segment was replaced (node restart): reopen the transport."""
        return self._shm.is_current()

    def _check_segment(self) -> None:
        if not self._shm.is_current():
            raise TransferError(f"{self.control.address}: segment {self._shm.name} is gone (node restarted?)")

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
        self._check_segment()
        if extents is None:
            where = await self.control.request(Request(Op.LOCATE, list(keys), caps=list(caps)))
            if not where.ok or len(where.offsets) != len(keys):
                raise TransferError(f"{self.control.address}: locate refused: {where.error}")
            extents = [Extent(o, s) for o, s in zip(where.offsets, where.sizes)]
        elif len(extents) != len(keys) or any(o < 0 or o + s > self._shm.size for o, s in extents):
            raise ValueError("one extent per key, inside the node's DRAM segment")
        # the segment (or, for blocks not in DRAM, a TCP read by the node from its lower tiers)
        sources: list[memoryview | None] = [
            self._seg[offset : offset + size] if size != MISSING else None for offset, size in extents
        ]
        _READ.inc(sum(src.nbytes for src in sources if src is not None))  # lower tiers count as TCP
        lower = [i for i, src in enumerate(sources) if src is None]
        if lower:
            lower_caps = [caps[i] for i in lower] if caps else []
            for i, view in zip(lower, await self.control.read([keys[i] for i in lower], caps=lower_caps,
                                                              missing_ok=True)):
                sources[i] = view
        sizes = [0 if src is None else src.nbytes for src in sources]  # NOTE: blocks are never empty
        out = destination(into, sum(sizes))
        starts = list(accumulate(sizes, initial=0))
        views = [out[start : start + size] if size else None for start, size in zip(starts, sizes)]
        try:
            for i, view in enumerate(views):
                if view is not None:
                    view[:] = sources[i]  # type: ignore[index]
                    if check is not None:  # NOTE: on the private copy: any same-host client can write the segment
                        check(i, view)
        finally:  # NOTE: a raised hook's traceback keeps this frame: no segment view may outlive the call
            sources.clear()
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
        self._check_segment()
        if offsets is None:
            resp = await self.control.request(Request(Op.RESERVE, list(keys), sizes, caps=list(caps)))
            if not resp.ok:
                raise TransferError(f"{self.control.address}: reserve refused: {resp.error}")
            targets = resp.offsets
        else:
            targets = list(offsets)
        if any(o < 0 or o + s > self._shm.size for o, s in zip(targets, sizes)):
            raise ValueError("offsets fall outside the node's DRAM segment")
        for i, (offset, size, payload) in enumerate(zip(targets, sizes, payloads)):
            src = memoryview(payload).cast("B")
            if prepare is not None:  # right before its copy, which then reads it from cache
                prepare(i, src)
            self._seg[offset : offset + size] = src
        # with the cache-manager's offsets, COMMIT carries the extents and claims them in one step
        await self.commit(keys, sizes, list(targets) if offsets is not None else None, caps)
        _WRITTEN.inc(sum(sizes))

    ranged = True

    def _ranges(self, ranges: Sequence[SegmentRange]) -> None:
        self._check_segment()
        if any(r.offset < 0 or r.length <= 0 or r.offset + r.length > self._shm.size for r in ranges):
            raise ValueError("ranges must be non-empty and inside the node's DRAM segment")

    async def write_ranges(self, ranges: Sequence[SegmentRange], payloads: Sequence[Buffer]) -> None:
        """Bytes into extents the cache-manager placed (not yet committed: ``commit`` claims them)."""
        self._ranges(ranges)
        local = [memoryview(p).cast("B") for p in payloads]
        if len(local) != len(ranges) or any(v.nbytes != r.length for v, r in zip(local, ranges)):
            raise ValueError("one payload per range, of the range's length")
        for r, view in zip(ranges, local):
            self._seg[r.offset : r.offset + r.length] = view
        _WRITTEN.inc(sum(r.length for r in ranges))

    async def read_ranges(self, ranges: Sequence[SegmentRange], *, into: memoryview | None = None) -> list[memoryview]:
        self._ranges(ranges)
        out, views, pos = destination(into, sum(r.length for r in ranges)), [], 0
        for r in ranges:
            views.append(out[pos : pos + r.length])
            views[-1][:] = self._seg[r.offset : r.offset + r.length]
            pos += r.length
        _READ.inc(pos)
        return views

    async def commit(self, keys: Sequence[bytes], sizes: Sequence[int], offsets: Sequence[int] | None = None,
                     caps: Sequence[bytes] = ()) -> None:
        """Make written blocks visible; with the cache-manager's ``offsets`` this also claims them."""
        claim = offsets is not None
        req = Request(Op.COMMIT, list(keys), list(sizes) if claim else [], list(offsets or ()), caps=list(caps))
        resp = await self.control.request(req)
        if not resp.ok:
            raise TransferError(f"{self.control.address}: commit refused: {resp.error}")

    async def delete(self, keys: Sequence[bytes], *, caps: Sequence[bytes] = ()) -> int:
        return await self.control.delete(keys, caps=caps)

    async def close(self) -> None:
        await self.control.close()
        self._seg.release()
        self._shm.close()


