"""NVMe tier: one file per block in a directory, written atomically (temp file + rename)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import aiofiles
import aiofiles.os

from halfmoon.storage.base import BlockNotFound, Buffer, StorageTier, TierFull, TierUsage, check_key

_SUFFIX = ".blk"


class DirTier(StorageTier):
    """Blocks as ``<root>/<hex[:2]>/<hex>.blk``; a crash mid-write leaves only a ``.tmp`` file,
    which the next start removes, so a visible file is always a complete block."""

    def __init__(self, root: str | os.PathLike[str], capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.root = Path(root)
        self._capacity = capacity
        self.root.mkdir(parents=True, exist_ok=True)
        self._sizes: dict[bytes, int] = {}
        for path in self.root.glob("*/*"):
            if path.name.endswith(_SUFFIX):
                self._sizes[bytes.fromhex(path.name[: -len(_SUFFIX)])] = path.stat().st_size
            else:
                path.unlink()  # leftover temp file of an interrupted write
        self._used = sum(self._sizes.values())

    @property
    def capacity(self) -> int:
        return self._capacity

    def _path(self, key: bytes) -> Path:
        name = check_key(key).hex()
        return self.root / name[:2] / (name + _SUFFIX)

    async def put(self, key: bytes, data: Buffer) -> None:
        path = self._path(key)
        size = memoryview(data).nbytes
        growth = size - self._sizes.get(key, 0)
        if self._used + growth > self.capacity:
            raise TierFull(f"{size} bytes do not fit ({self._used} of {self.capacity} used)")
        await aiofiles.os.makedirs(path.parent, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            async with aiofiles.open(tmp, "wb") as f:
                await f.write(data)
            await aiofiles.os.replace(tmp, path)
        except BaseException:
            if await aiofiles.os.path.exists(tmp):
                await aiofiles.os.remove(tmp)
            raise
        self._used += growth
        self._sizes[key] = size

    async def get(self, key: bytes) -> bytes:
        try:
            async with aiofiles.open(self._path(key), "rb") as f:
                return await f.read()
        except FileNotFoundError:
            raise BlockNotFound([key]) from None

    async def delete(self, key: bytes) -> bool:
        try:
            await aiofiles.os.remove(self._path(key))
        except FileNotFoundError:
            return False
        self._used -= self._sizes.pop(key, 0)
        return True

    async def contains(self, key: bytes) -> bool:
        return key in self._sizes

    async def list(self) -> list[bytes]:
        return list(self._sizes)

    async def sizes(self) -> dict[bytes, int]:
        return dict(self._sizes)

    async def usage(self) -> TierUsage:
        return TierUsage(self._used, self.capacity, len(self._sizes))
