"""Named shared-memory segments: created by a transfer node, attached by same-host clients."""

from __future__ import annotations

from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory


def create_segment(name: str | None, size: int) -> SharedMemory:
    """A new segment owned by the caller, who must ``close()`` and ``unlink()`` it."""
    if size <= 0:
        raise ValueError(f"segment size must be positive, got {size}")
    return SharedMemory(name=name, create=True, size=size)


def attach_segment(name: str) -> SharedMemory:
    """Map an existing segment; the attaching process never unlinks it."""
    shm = SharedMemory(name=name, create=False)
    # NOTE: Python < 3.13 registers attached segments with the resource tracker, which would
    # unlink the owner's segment when this process exits; only the creator may unlink.
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm
