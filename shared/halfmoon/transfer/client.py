"""Picks a transport per transfer node: shared memory when the node is on this host, else TCP."""

from __future__ import annotations

import logging

from halfmoon.storage.segment import AttachedSegment
from halfmoon.transfer.framing import Op, Request
from halfmoon.transfer.server import host_identity
from halfmoon.transfer.shm import ShmTransport
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import TransferError, Transport

log = logging.getLogger(__name__)


class TransferClient:
    """Contract: ``transport(address)`` returns the same Transport for the same node until
    ``close``, except that a same-host transport whose node replaced its segment (restart) is
    reopened; ``same_host=False`` forces TCP (benchmarks, tests, cross-host setups)."""

    def __init__(self, pool_size: int = 4, same_host: bool = True) -> None:
        self._pool_size = pool_size
        self._same_host = same_host
        self._transports: dict[str, Transport] = {}

    async def transport(self, address: str) -> Transport:
        cached = self._transports.get(address)
        if isinstance(cached, ShmTransport) and not cached.current:  # the node restarted
            await cached.close()
            cached = None
        if cached is None:
            cached = self._transports[address] = await self._open(address)
        return cached

    async def _open(self, address: str) -> Transport:
        tcp = TcpTransport(address, self._pool_size)
        if not self._same_host:
            return tcp
        hello = await tcp.request(Request(Op.HELLO))
        if not hello.ok:
            raise TransferError(f"{address}: hello refused: {hello.error}")
        if hello.host != host_identity() or not hello.segment:
            return tcp
        try:
            segment = AttachedSegment(hello.segment)
        except OSError as exc:  # same kernel, different /dev/shm (containers)
            log.info("segment %s of %s not attachable (%s): using TCP", hello.segment, address, exc)
            return tcp
        return ShmTransport(tcp, segment)

    async def close(self) -> None:
        for transport in self._transports.values():
            await transport.close()
        self._transports.clear()
