"""First-fit extent allocator with coalescing, for one contiguous DRAM segment.

Why first-fit over a free list rather than fixed-size slabs: block sizes depend on the model,
dtype and block size, and one pool can serve several models, so a slab size fixed up front
either wastes up to half of each slot or needs a slab class per size. With the typical
workload (many equal-sized blocks) first-fit with coalescing behaves like a slab allocator
anyway: freed holes are exactly reusable by the next block of the same size, and adjacent
holes merge so a larger block can still find room. The free list is kept sorted by offset,
so coalescing is a neighbour check after a binary search.

The allocator is pure bookkeeping (no I/O): the cache-manager runs one per transfer node as
the authority on offsets, and the node's DRAM tier runs one that mirrors it via ``claim``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple


class OutOfSpace(MemoryError):
    """No free extent is large enough (the segment may still have that much free in total)."""


class Extent(NamedTuple):
    offset: int
    size: int


class ExtentAllocator:
    """Hands out aligned, non-overlapping extents of ``[0, capacity)``.

    Contract: ``allocate`` returns the lowest-offset free extent that fits (first fit);
    ``claim`` reserves a caller-chosen extent and fails if any byte of it is in use;
    ``free`` takes the offset of a live extent and merges it with free neighbours.
    Sizes are rounded up to ``alignment``; ``used`` counts rounded sizes.
    """

    def __init__(self, capacity: int, alignment: int = 64) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity - capacity % alignment
        self.alignment = alignment
        self._starts: list[int] = [0]  # free extents, sorted by offset, never adjacent
        self._sizes: list[int] = [self.capacity]
        self._live: dict[int, int] = {}  # offset -> rounded size
        self.used = 0

    def _round(self, size: int) -> int:
        if size <= 0:
            raise ValueError(f"extent size must be positive, got {size}")
        return (size + self.alignment - 1) & ~(self.alignment - 1)

    def allocate(self, size: int) -> Extent:
        need = self._round(size)
        for i, free in enumerate(self._sizes):
            if free >= need:
                offset = self._starts[i]
                self._take(i, offset, need)
                return Extent(offset, size)
        raise OutOfSpace(f"no free extent of {need} bytes (free {self.free_bytes} of {self.capacity})")

    def allocate_run(self, sizes: Sequence[int]) -> list[Extent]:
        """Extents for a batch, back to back in the first free extent that holds them all (one
        scan and one split for the batch, not one per block), else each placed by ``allocate``;
        either way each is freed on its own. All or nothing: ``OutOfSpace`` leaves nothing taken."""
        needs = [self._round(s) for s in sizes]
        total = sum(needs)
        i = next((i for i, free in enumerate(self._sizes) if free >= total), None)
        if i is None:
            taken: list[Extent] = []
            try:
                for size in sizes:
                    taken.append(self.allocate(size))
            except OutOfSpace:
                for ext in taken:
                    self.free(ext.offset)
                raise
            return taken
        offset = self._starts[i]
        self._take(i, offset, total)
        del self._live[offset]
        out = []
        for size, need in zip(sizes, needs):
            self._live[offset] = need
            out.append(Extent(offset, size))
            offset += need
        return out

    def _free_extent_at(self, offset: int, size: int) -> int | None:
        """Index of the free extent wholly containing ``[offset, offset + size)``, if any."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset + self._round(size) > self._starts[i] + self._sizes[i]:
            return None
        return i

    def is_free(self, offset: int, size: int) -> bool:
        return self._free_extent_at(offset, size) is not None

    def claim(self, offset: int, size: int) -> Extent:
        need = self._round(size)
        if offset % self.alignment:
            raise ValueError(f"offset {offset} is not aligned to {self.alignment}")
        i = self._free_extent_at(offset, size)
        if i is None:
            raise OutOfSpace(f"extent [{offset}, {offset + need}) is not free")
        self._take(i, offset, need)
        return Extent(offset, size)

    def _take(self, i: int, offset: int, need: int) -> None:
        start, size = self._starts[i], self._sizes[i]
        head, tail = offset - start, start + size - (offset + need)
        pieces = [(s, n) for s, n in ((start, head), (offset + need, tail)) if n > 0]
        self._starts[i : i + 1] = [s for s, _ in pieces]
        self._sizes[i : i + 1] = [n for _, n in pieces]
        self._live[offset] = need
        self.used += need

    def free(self, offset: int) -> None:
        self.free_many([offset])

    def free_many(self, offsets: Sequence[int]) -> None:
        """``free`` each; live extents that touch are returned as one span (a batch placed by
        ``allocate_run`` costs one merge, not one per block). All or nothing: ``KeyError``
        (naming an offset that is not a live extent, or one named twice) frees none."""
        unique = sorted(set(offsets))
        if len(unique) != len(offsets) or any(o not in self._live for o in unique):
            bad = next((o for o in offsets if o not in self._live), None)
            raise KeyError(f"no live extent at offset {bad}" if bad is not None else "an offset named twice")
        spans: list[list[int]] = []
        for offset in unique:
            size = self._live.pop(offset)
            self.used -= size
            if spans and spans[-1][1] == offset:
                spans[-1][1] = offset + size
            else:
                spans.append([offset, offset + size])
        for start, end in spans:
            self._release(start, end)

    def _release(self, start: int, end: int) -> None:
        """Put ``[start, end)`` back on the free list, merged with free neighbours."""
        i = bisect.bisect_left(self._starts, start)
        merge_prev = i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start
        merge_next = i < len(self._starts) and self._starts[i] == end
        if merge_prev:
            start = self._starts[i - 1]
        if merge_next:
            end = self._starts[i] + self._sizes[i]
        lo, hi = (i - 1 if merge_prev else i), (i + 1 if merge_next else i)
        self._starts[lo:hi] = [start]
        self._sizes[lo:hi] = [end - start]

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        return max(self._sizes, default=0)

    @property
    def fragments(self) -> int:
        """Number of separate free extents (1 means no fragmentation)."""
        return len(self._starts)
