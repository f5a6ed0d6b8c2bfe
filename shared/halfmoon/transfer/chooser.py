"""Per peer, the transports both ends have, fastest first: shared memory (same host), RDMA,
Mooncake's transfer engine, and TCP, which every node serves and which always comes last.

A node offers paths (``Offers``: its RDMA endpoint, its Mooncake session) and this process has
some (``Openers``: an opened RDMA device, a running Mooncake engine). ``path_kinds`` is the
pure choice; ``TransportChooser`` opens and caches the transports for the failover reader.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import NamedTuple

import msgspec

from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.failover import Path
from halfmoon.transfer.shm import ShmTransport
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import TransferError, Transport

PREFERENCE = ("shm", "rdma", "mooncake", "tcp")


class Offers(msgspec.Struct, frozen=True):
    """What a transfer node offers beyond TCP; each value is that path's connect information
    (raw msgpack-able, decoded by the path's opener), absent when the node lacks the path."""

    rdma: dict | None = None
    mooncake: dict | None = None

    def kinds(self) -> set[str]:
        return {k for k in ("rdma", "mooncake") if getattr(self, k) is not None}


NO_OFFERS = Offers()


def path_kinds(local: set[str], offered: set[str], same_host: bool) -> list[str]:
    """Paths both ends have, in preference order; shared memory only on one host, TCP always."""
    usable = (local & offered) | {"tcp"}
    if same_host:
        usable.add("shm")
    return [k for k in PREFERENCE if k in usable]


class Opener(NamedTuple):
    """Opens one kind of path to a node: ``(address, control, connect info) -> transport``."""

    kind: str
    open: Callable[[str, TcpTransport, dict], Awaitable[Transport]]


class TransportChooser:
    """Contract: ``paths(address, offers)`` returns the node's transports in preference order,
    the same objects until ``close``; a path whose opener fails is left out (logged in
    ``open_errors``) and TCP or shared memory, from the ``TransferClient``, is always there."""

    def __init__(self, openers: Sequence[Opener] = (), base: TransferClient | None = None) -> None:
        self._openers: Mapping[str, Opener] = {o.kind: o for o in openers}
        self._base = base or TransferClient()
        self._paths: dict[str, list[Path]] = {}
        self.open_errors: dict[tuple[str, str], str] = {}

    async def paths(self, address: str, offers: Offers = NO_OFFERS) -> list[Path]:
        cached = self._paths.get(address)
        if cached is not None:
            return cached
        base = await self._base.transport(address)
        control = base.control if isinstance(base, ShmTransport) else base
        assert isinstance(control, TcpTransport)
        kinds = path_kinds(set(self._openers), offers.kinds(), isinstance(base, ShmTransport))
        out: list[Path] = []
        for kind in kinds:
            if kind in ("shm", "tcp"):
                # the base transport is the node's shared-memory path when it is attachable, else TCP
                if (kind == "shm") == isinstance(base, ShmTransport):
                    out.append(Path(kind, base))
                elif kind == "tcp":
                    out.append(Path(kind, control))
                continue
            # NOTE: each path gets its own control connection pool: closing one path never closes another's
            own = TcpTransport(address, timeout_s=control.timeout_s)
            try:
                out.append(Path(kind, await self._openers[kind].open(address, own, getattr(offers, kind))))
            except (TransferError, OSError, RuntimeError, ValueError, msgspec.ValidationError) as exc:
                await own.close()
                self.open_errors[(address, kind)] = f"{type(exc).__name__}: {exc}"
        self._paths[address] = out
        return out

    async def close(self) -> None:
        for paths in self._paths.values():
            for p in paths:
                if p.kind in ("rdma", "mooncake"):
                    await p.transport.close()
        self._paths.clear()
        await self._base.close()
