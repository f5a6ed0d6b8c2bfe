"""The storage-tier contract shared by DRAM, NVMe and S3 tiers, and its typed errors."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

from halfmoon.core.keys import key_hex

Buffer = bytes | bytearray | memoryview


class StorageError(Exception):
    """Base of the storage layer's typed errors."""


class BlockNotFound(StorageError, KeyError):
    """The tier (or node) does not hold these keys; callers treat it as a cache miss."""

    def __init__(self, keys: list[bytes]) -> None:
        super().__init__(f"{len(keys)} block(s) not found: {', '.join(key_hex(k) for k in keys[:4])}")
        self.keys = keys

    def __str__(self) -> str:
        return str(self.args[0])


class TierFull(StorageError):
    """The tier has no room for the block; nothing was written."""


class TierUnavailable(StorageError):
    """The tier's backend cannot be reached (e.g. the S3 endpoint is down); other tiers still serve."""


class TierUsage(NamedTuple):
    used: int
    capacity: int
    blocks: int


class StorageTier(ABC):
    """A key -> opaque bytes store on one node.

    Contract: keys are 32-byte block keys. ``put`` stores a complete block atomically (readers
    never see a partial one) and replaces an existing value; ``get`` returns the bytes or raises
    ``BlockNotFound``; ``delete`` returns whether the key was present. Backend outages raise
    ``TierUnavailable``; a full tier raises ``TierFull``. All methods may be awaited from the
    event loop without blocking it for longer than a memory copy.
    """

    @abstractmethod
    async def put(self, key: bytes, data: Buffer) -> None: ...

    @abstractmethod
    async def get(self, key: bytes) -> bytes: ...

    @abstractmethod
    async def delete(self, key: bytes) -> bool: ...

    @abstractmethod
    async def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    async def list(self) -> list[bytes]: ...

    @abstractmethod
    async def sizes(self) -> dict[bytes, int]:
        """Every stored key with its size in bytes (one listing, no reads)."""

    @abstractmethod
    async def usage(self) -> TierUsage: ...

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Configured bytes."""

    async def close(self) -> None:  # noqa: B027 - a tier holding no resources has nothing to release
        """Release the tier's resources (the stored blocks survive where the backend is durable)."""


def check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != 32:
        raise ValueError(f"block keys are 32 bytes, got {key!r:.80}")
    return key
