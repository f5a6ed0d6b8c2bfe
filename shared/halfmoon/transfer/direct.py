"""What the transports that address the node's DRAM segment directly share (shared memory, one-sided
RDMA and Mooncake): only control messages cross the node's TCP connection, ``control`` (LOCATE before a
read, RESERVE or the cache-manager's offsets and COMMIT around a write), and so do the bytes of blocks
not in DRAM (demoted to NVMe/S3), which only the node can reach.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Sequence

from halfmoon.core.tiers import Tier
from halfmoon.storage.allocator import Extent
from halfmoon.storage.base import Buffer
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.framing import MISSING, Op, Request
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import (
    BlockHook,
    ReadBatch,
    SegmentRange,
    TransferError,
    Transport,
    WriteBatch,
    back_to_back,
    block_views,
    destination,
)

# where each block of a read comes from: its DRAM extent (MISSING when it is nowhere) or its copy from a lower tier
Source = Extent | memoryview


class DirectTransport(Transport):
    """Implementations move bytes between local views and segment ranges (``_move``), land a read's
    blocks (``_land``) and store a write's (``_write_dram``), each validated here first."""

    ranged = True

    def __init__(self, control: TcpTransport, kind: str, segment_size: int) -> None:
        self.control = control
        self.segment_size = segment_size
        self._read_bytes = METRICS.transfer_bytes.labels(kind, "read")
        self._written_bytes = METRICS.transfer_bytes.labels(kind, "write")

    @abstractmethod
    async def _move(self, write: bool, ranges: Sequence[SegmentRange], local: Sequence[memoryview]) -> None:
        """Copy each local view into its segment range (``write``) or the range into the view."""

    @abstractmethod
    async def _land(self, views: Sequence[memoryview | None], sources: Sequence[Source],
                    check: BlockHook | None) -> None:
        """Copy each block of a read from its source into its view, in key order, calling ``check``
        on each as the ``Transport`` contract says (a block without a view is missing)."""

    @abstractmethod
    async def _write_dram(self, batch: WriteBatch) -> None:
        """Store a batch in DRAM at ``_targets`` and ``commit`` it, calling ``prepare`` as the contract says."""

    def _check_attached(self) -> None:
        """Raise ``TransferError`` where the node's segment can be lost under a live transport."""

    def _check_ranges(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Each (offset, length) is non-empty and inside the segment."""
        if any(offset < 0 or length <= 0 or offset + length > self.segment_size for offset, length in ranges):
            raise ValueError("ranges must be non-empty and inside the node's DRAM segment")

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

    async def commit(self, keys: Sequence[bytes], sizes: Sequence[int], offsets: Sequence[int] | None = None,
                     caps: Sequence[bytes] = ()) -> None:
        """Make written blocks visible; with the cache-manager's ``offsets`` this also claims them."""
        claim = offsets is not None
        req = Request(Op.COMMIT, list(keys), list(sizes) if claim else [], list(offsets or ()), caps=list(caps))
        resp = await self.control.request(req)
        if not resp.ok:
            raise TransferError(f"{self.control.address}: commit refused: {resp.error}")

    async def _read(self, batch: ReadBatch) -> list[memoryview | None]:
        self._check_attached()
        extents: Sequence[Extent]
        if batch.extents is None:
            extents = await self.locate(batch.keys, batch.caps)
        elif len(batch.extents) != len(batch.keys) or any(
            size != MISSING and (offset < 0 or size <= 0 or offset + size > self.segment_size)
            for offset, size in batch.extents
        ):
            raise ValueError("one extent per key, inside the node's DRAM segment")
        else:
            extents = batch.extents
        sources: list[Source] = list(extents)
        sizes = [size for _, size in extents]
        lower = [i for i, size in enumerate(sizes) if size == MISSING]  # demoted (or absent): over TCP
        dram_bytes = sum(sizes) - MISSING * len(lower)
        if lower:
            caps = [batch.caps[i] for i in lower] if batch.caps else []
            for i, view in zip(lower, await self.control.read([batch.keys[i] for i in lower], caps=caps,
                                                              missing_ok=True)):
                if view is not None:
                    sources[i] = view
                    sizes[i] = view.nbytes
        # back to back in key order, whichever tier a block comes from
        _, views = block_views(batch.into, sizes)
        await self._land(views, sources, batch.check)
        self._read_bytes.inc(dram_bytes)  # lower tiers count as TCP
        return views

    async def _write(self, batch: WriteBatch) -> None:
        if batch.tier is not Tier.DRAM:  # only the node writes its lower tiers
            await self.control._write(batch)
            return
        self._check_attached()
        await self._write_dram(batch)

    async def _targets(self, batch: WriteBatch) -> list[int]:
        """The cache-manager's offsets, or the node's reservation for the batch."""
        if batch.offsets is not None:
            return list(batch.offsets)
        return await self.reserve(batch.keys, batch.sizes, batch.caps)

    async def read_ranges(self, ranges: Sequence[SegmentRange], *, into: memoryview | None = None) -> list[memoryview]:
        """Bytes of the segment, back to back in ``into`` (or a fresh buffer); the caller holds a
        lease or reservation that keeps the ranges valid."""
        self._check_attached()
        self._check_ranges(ranges)
        lengths = [r.length for r in ranges]
        views = back_to_back(destination(into, sum(lengths)), lengths)
        await self._move(False, ranges, views)
        self._read_bytes.inc(sum(lengths))
        return views

    async def write_ranges(self, ranges: Sequence[SegmentRange], payloads: Sequence[Buffer]) -> None:
        """Write into reserved, not yet committed extents (``reserve`` first, ``commit`` after)."""
        self._check_attached()
        self._check_ranges(ranges)
        local = [memoryview(p).cast("B") for p in payloads]
        if len(local) != len(ranges) or any(v.nbytes != r.length for v, r in zip(local, ranges)):
            raise ValueError("one payload per range, of the range's length")
        await self._move(True, ranges, local)
        self._written_bytes.inc(sum(r.length for r in ranges))

    async def delete(self, keys: Sequence[bytes], *, caps: Sequence[bytes] = ()) -> int:
        return await self.control.delete(keys, caps=caps)
