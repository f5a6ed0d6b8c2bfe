"""A process's transports to the transfer nodes: per node, every path both ends have (same-host
shared memory, RDMA, Mooncake's engine, TCP), fastest first, behind one failing-over Transport."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TypeGuard

import msgspec

from halfmoon.core.cluster_keys import DEV_KEYS, ClusterKeys
from halfmoon.storage.segment import AttachedSegment
from halfmoon.transfer.chooser import Opener, path_kinds
from halfmoon.transfer.failover import Path, PathFailover, PathHealth
from halfmoon.transfer.framing import NO_OFFERS, Op, Request
from halfmoon.transfer.server import host_identity
from halfmoon.transfer.shm import ShmTransport
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import TransferError, Transport

log = logging.getLogger(__name__)
OPEN_FAILURES = (TransferError, OSError, RuntimeError, ValueError, msgspec.ValidationError)


class TransferClient:
    """Contract: ``transport(address)`` returns the same Transport for the same node until
    ``close``, except that one whose same-host segment the node replaced (restart) is reopened.
    It is the node's only path, or a ``PathFailover`` over ``paths(address)``: shared memory
    when the node is on this host (``same_host=False`` forbids it: benchmarks, tests), then each
    of this process's ``openers`` the node offers, then TCP, always. A path that fails to open
    is left out, its reason in ``open_errors``; all paths share one ``health``."""

    def __init__(self, pool_size: int = 4, same_host: bool = True, keys: ClusterKeys = DEV_KEYS,
                 openers: Sequence[Opener] = ()) -> None:
        self._pool_size = pool_size
        self._keys = keys
        self._same_host = same_host
        self._openers = {o.kind: o for o in openers}
        self._transports: dict[str, Transport] = {}
        self.health = PathHealth()
        self.open_errors: dict[tuple[str, str], str] = {}

    async def transport(self, address: str) -> Transport:
        cached = self._transports.get(address)
        if cached is not None and _stale(cached):  # the node restarted: new paths, no failures held against them
            await cached.close()
            for path in cached.paths:
                self.health.succeeded(address, path.kind)
            cached = None
        if cached is None:
            paths = await self._open(address)
            cached = paths[0].transport if len(paths) == 1 else PathFailover(address, paths, self.health)
            self._transports[address] = cached
        return cached

    async def paths(self, address: str) -> list[Path]:
        """The node's paths, fastest first (``FailoverReader``'s source)."""
        transport = await self.transport(address)
        return transport.paths if isinstance(transport, PathFailover) else [Path("tcp", transport)]

    async def _open(self, address: str) -> list[Path]:
        tcp = TcpTransport(address, self._pool_size, keys=self._keys)
        if not self._same_host and not self._openers:
            return [Path("tcp", tcp)]
        hello = await tcp.request(Request(Op.HELLO))
        if not hello.ok:
            raise TransferError(f"{address}: hello refused: {hello.error}")
        shm = self._attach(address, tcp, hello.segment) if hello.host == host_identity() else None
        paths = []
        for kind in path_kinds(set(self._openers), (hello.offers or NO_OFFERS).kinds(), shm is not None):
            if kind == "shm":
                assert shm is not None, "path_kinds offers shm only with the segment attached"
                paths.append(Path(kind, shm))
            elif kind == "tcp":
                paths.append(Path(kind, tcp))
            else:
                own = TcpTransport(address, self._pool_size, keys=self._keys)  # closing one path never closes another's
                try:
                    paths.append(Path(kind, await self._openers[kind].open(address, own, getattr(hello.offers, kind))))
                except OPEN_FAILURES as exc:
                    await own.close()
                    self.open_errors[(address, kind)] = f"{type(exc).__name__}: {exc}"
                    log.warning("%s path to %s did not open: %s", kind, address, exc)
        return paths

    def _attach(self, address: str, tcp: TcpTransport, segment: str) -> ShmTransport | None:
        if not self._same_host or not segment:
            return None
        try:
            return ShmTransport(tcp, AttachedSegment(segment))
        except OSError as exc:  # same kernel, different /dev/shm (containers)
            log.info("segment %s of %s not attachable (%s): using TCP", segment, address, exc)
            return None

    async def close(self) -> None:
        for transport in self._transports.values():
            await transport.close()
        self._transports.clear()


def _stale(transport: Transport) -> TypeGuard[PathFailover]:
    """A node's only path is TCP, which outlives a restart; more paths may include its old segment."""
    return isinstance(transport, PathFailover) and any(
        isinstance(p.transport, ShmTransport) and not p.transport.current for p in transport.paths)
