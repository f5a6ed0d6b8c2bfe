"""DRAM tier: blocks in one named shared-memory segment, placed by an extent allocator.

Same-host clients attach the segment by name and read or write blocks in place at the
offsets this tier reports (``locate``) or that the cache-manager chose (``reserve`` with an
offset); only the control message crosses the socket. The cache-manager's offsets win: a
write at an offset that overlaps stale blocks (whose FREE order has not arrived yet) evicts them.
"""

from __future__ import annotations

from collections.abc import Sequence

from halfmoon.storage.allocator import Extent, ExtentAllocator, OutOfSpace
from halfmoon.storage.base import BlockNotFound, Buffer, StorageTier, TierFull, TierUsage, check_key
from halfmoon.storage.segment import create_segment, segment_buffer


class ShmTier(StorageTier):
    def __init__(self, capacity: int, name: str | None = None, alignment: int = 64) -> None:
        self._alloc = ExtentAllocator(capacity, alignment)
        self._shm = create_segment(name, self._alloc.capacity)
        self._buf = segment_buffer(self._shm)  # NOTE: never released separately; SharedMemory.close() does
        self._blocks: dict[bytes, Extent] = {}  # visible blocks
        self._pending: dict[bytes, Extent] = {}  # reserved, being written in place

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def segment(self) -> str:
        return self._shm.name

    @property
    def segment_view(self) -> memoryview:
        """The whole segment, for registering it with one-sided paths (RDMA, Mooncake)."""
        return self._buf

    # ---- in-place protocol -------------------------------------------------------------
    def reserve(self, key: bytes, size: int, offset: int | None = None) -> Extent:
        """Room for ``key`` (at ``offset`` when the cache-manager chose it), invisible until ``commit``."""
        check_key(key)
        self.abort(key)
        try:
            if offset is None:
                ext = self._alloc.allocate(size)
            else:
                if not self._alloc.is_free(offset, size):  # the scan is O(blocks): only when needed
                    self._evict_overlapping(offset, size)
                ext = self._alloc.claim(offset, size)
        except OutOfSpace as exc:
            raise TierFull(str(exc)) from None
        self._pending[key] = ext
        return ext

    def reserve_batch(self, keys: Sequence[bytes], sizes: Sequence[int],
                      offsets: Sequence[int] | None = None) -> list[Extent]:
        """``reserve`` for a batch, all or nothing; without ``offsets`` the blocks are placed back
        to back where they fit together (``ExtentAllocator.allocate_run``)."""
        if offsets is None and len(set(keys)) == len(keys):
            for key in keys:
                check_key(key)
                self.abort(key)
            try:
                exts = self._alloc.allocate_run(sizes)
            except OutOfSpace as exc:
                raise TierFull(str(exc)) from None
            self._pending.update(zip(keys, exts))
            return exts
        exts = []
        try:
            for i, (key, size) in enumerate(zip(keys, sizes)):
                exts.append(self.reserve(key, size, None if offsets is None else offsets[i]))
        except BaseException:
            for key in keys:
                self.abort(key)
            raise
        return exts

    def commit(self, key: bytes) -> Extent:
        """Make a reserved block visible, replacing any older value of the key."""
        try:
            ext = self._pending.pop(key)
        except KeyError:
            raise BlockNotFound([key]) from None
        self._discard(self._blocks, key)
        self._blocks[key] = ext
        return ext

    def commit_batch(self, keys: Sequence[bytes]) -> list[bytes]:
        """``commit`` each reserved key; returns the keys that were not reserved (nothing done for them)."""
        missing, stale = [], []
        for key in dict.fromkeys(keys):  # a key named twice is committed once
            ext = self._pending.pop(key, None)
            if ext is None:
                missing.append(key)
                continue
            old = self._blocks.get(key)
            if old is not None:
                stale.append(old.offset)
            self._blocks[key] = ext
        self._alloc.free_many(stale)  # the older values, in one pass
        return missing

    def abort(self, key: bytes) -> None:
        self._discard(self._pending, key)

    def writable(self, ext: Extent) -> memoryview:
        return self._buf[ext.offset : ext.offset + ext.size]

    def locate(self, key: bytes) -> Extent:
        try:
            return self._blocks[key]
        except KeyError:
            raise BlockNotFound([key]) from None

    def find(self, key: bytes) -> Extent | None:
        """The extent of a visible block, or None."""
        return self._blocks.get(key)

    def is_reserved(self, key: bytes) -> bool:
        return key in self._pending

    def view(self, key: bytes) -> memoryview:
        """Zero-copy view of a stored block; valid until the block is deleted or overwritten."""
        return self.writable(self.locate(key))

    def inventory(self) -> list[tuple[bytes, Extent]]:
        return list(self._blocks.items())

    def _evict_overlapping(self, offset: int, size: int) -> None:
        end = offset + size
        for table in (self._blocks, self._pending):
            for key in [k for k, e in table.items() if e.offset < end and offset < e.offset + e.size]:
                self._discard(table, key)

    def _discard(self, table: dict[bytes, Extent], key: bytes) -> bool:
        ext = table.pop(key, None)
        if ext is None:
            return False
        self._alloc.free(ext.offset)
        return True

    # ---- StorageTier -------------------------------------------------------------------
    async def put(self, key: bytes, data: Buffer, offset: int | None = None) -> None:
        src = memoryview(data).cast("B")
        ext = self.reserve(key, src.nbytes, offset)
        self.writable(ext)[:] = src
        self.commit(key)

    async def get(self, key: bytes) -> bytes:
        return bytes(self.view(key))

    async def delete(self, key: bytes) -> bool:
        return self._discard(self._blocks, key)

    async def contains(self, key: bytes) -> bool:
        return key in self._blocks

    async def list(self) -> list[bytes]:
        return list(self._blocks)

    async def sizes(self) -> dict[bytes, int]:
        return {k: ext.size for k, ext in self._blocks.items()}

    async def usage(self) -> TierUsage:
        return TierUsage(self._alloc.used, self._alloc.capacity, len(self._blocks))

    async def close(self) -> None:
        """Unlink the segment (first, so its name never outlives the tier), then unmap it;
        unmapping raises BufferError while a view handed out by ``view``/``writable`` is alive."""
        self._blocks.clear()
        self._pending.clear()
        self._shm.unlink()
        self._shm.close()
