"""Local memory for one-sided transfers: long-lived registered buffers plus a registered staging area.

RDMA and Mooncake can only move bytes between registered regions. Registering is slow
(pins pages, a syscall per region), so it happens once per long-lived buffer: the caller
``pin``s what it reuses (the engine's KV pages), and everything else is staged through one
registered scratch buffer that grows by doubling. Views returned to callers never point into
the staging buffer: staged reads are copied out, as the ``Transport`` contract requires.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np

from halfmoon.storage.base import Buffer
from halfmoon.transfer.rdma_plan import Region, Registrations


def address_of(buf: Buffer) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too)."""
    view = memoryview(buf)
    if not view.contiguous:
        raise ValueError("one-sided transfers need contiguous buffers")
    return int(np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data) if view.nbytes else 0


H = TypeVar("H")  # what a registration returns: an ibv memory region, Mooncake's address


class Registrar(Protocol[H]):
    """What registers memory with a device or engine (``ibv_reg_mr``, Mooncake's ``register_memory``)."""

    def register(self, region: Region) -> H: ...

    def unregister(self, handle: H) -> None: ...


class LocalMemory(Generic[H]):
    """Contract: ``pin(buf)`` registers ``buf`` once (idempotent) and keeps a reference, so its
    pages stay valid while registered; ``staging(n)`` returns a registered writable buffer of at
    least ``n`` bytes, valid until the next ``staging`` call (callers hold ``lock`` around
    their use); ``pinned(buf)`` tells whether a transfer can use ``buf`` in place."""

    def __init__(self, registrar: Registrar[H], initial_staging: int = 1 << 20) -> None:
        self._registrar = registrar
        self.registrations: Registrations[H] = Registrations()
        self._keep: list[object] = []
        self._staging: bytearray | None = None
        self._staging_region: Region | None = None
        self._initial = initial_staging
        self.lock = threading.Lock()

    def pin(self, buf: Buffer) -> None:
        view = memoryview(buf).cast("B")
        for region in self.registrations.missing([(address_of(view), view.nbytes)]):
            self.registrations.add(region, self._registrar.register(region))
        self._keep.append(buf)

    def pinned(self, buf: Buffer) -> bool:
        view = memoryview(buf)
        try:
            self.registrations.handle(address_of(view), view.nbytes)
        except KeyError:
            return False
        return True

    def staging(self, nbytes: int) -> memoryview:
        if self._staging is None or len(self._staging) < nbytes:
            size = max(self._initial, len(self._staging or b"") * 2, nbytes)
            if self._staging_region is not None:
                self._registrar.unregister(self.registrations.remove(self._staging_region))
            self._staging = bytearray(size)
            # NOTE: registered exactly (not page-rounded): the region must not cover memory we do not own
            self._staging_region = Region(address_of(self._staging), size)
            self.registrations.add(self._staging_region, self._registrar.register(self._staging_region))
        return memoryview(self._staging)[:nbytes]

    def close(self) -> None:
        for handle in self.registrations.handles():
            self._registrar.unregister(handle)
        self.registrations = Registrations()
        self._keep.clear()
        self._staging = self._staging_region = None


def stage_out(staging: memoryview, payloads: Sequence[Buffer]) -> list[memoryview]:
    """Copy payloads back to back into the staging buffer; returns where each landed."""
    out, pos = [], 0
    for p in payloads:
        src = memoryview(p).cast("B")
        staging[pos : pos + src.nbytes] = src
        out.append(staging[pos : pos + src.nbytes])
        pos += src.nbytes
    return out
