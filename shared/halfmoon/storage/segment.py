"""Named shared-memory segments: created by a transfer node, attached by same-host clients."""

from __future__ import annotations

import mmap
import os
from multiprocessing.shared_memory import SharedMemory

SHM_DIR = "/dev/shm"
SEGMENT_MODE = 0o600  # only the node's user maps it; peers learn its name only after the handshake


def create_segment(name: str | None, size: int) -> SharedMemory:
    """A new segment owned by the caller, who must ``close()`` and ``unlink()`` it; private to its user."""
    if size <= 0:
        raise ValueError(f"segment size must be positive, got {size}")
    shm = SharedMemory(name=name, create=True, size=size)
    # NOTE: explicit, not left to SharedMemory's default and the umask
    os.fchmod(shm._fd, SEGMENT_MODE)  # type: ignore[attr-defined]  # typeshed omits POSIX SharedMemory's _fd
    return shm


def segment_buffer(shm: SharedMemory) -> memoryview:
    """The mapping of an open segment (``SharedMemory.buf`` is None only once it is closed)."""
    buf = shm.buf
    if buf is None:
        raise ValueError(f"segment {shm.name} is closed")
    return buf


class AttachedSegment:
    """A mapping of another process's segment. It is mapped directly rather than through
    SharedMemory, whose resource tracker (Python < 3.13) would unlink the owner's segment
    when the attaching process exits."""

    def __init__(self, name: str) -> None:
        self._path = os.path.join(SHM_DIR, name.lstrip("/"))
        fd = os.open(self._path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            self.size = st.st_size
            self._identity = (st.st_dev, st.st_ino)
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self._mmap)

    def is_current(self) -> bool:
        """Whether the name still refers to the mapped segment (False once the owner unlinked
        it, e.g. the node restarted): the mapping would then read and write orphaned memory."""
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()
