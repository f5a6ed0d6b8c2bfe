"""A framed message channel over one non-blocking TCP socket, driven by the asyncio loop.

It uses ``loop.sock_sendall`` / ``loop.sock_recv_into`` rather than StreamReader/Writer:
payloads go out straight from the caller's buffers (e.g. views into the DRAM segment) and come
in straight into preallocated buffers, where streams would copy every byte through their
internal bytearray once on each side.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterable

import msgspec

from halfmoon.storage.base import Buffer
from halfmoon.telemetry import inject_headers
from halfmoon.transfer.framing import LEN, MAX_HEADER, FramingError, Request, Response, encode


class ChannelClosed(ConnectionError):
    """The peer closed the connection."""


class Channel:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._len = bytearray(LEN.size)

    @classmethod
    async def connect(cls, host: str, port: int) -> Channel:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    def peer_gone(self) -> bool:
        """Whether the idle peer has closed its end (or reset it): a pooled connection to a node
        that restarted, which must not carry the next request."""
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False  # open, nothing to read: the normal idle state
        except OSError:
            return True

    async def send(self, header: Request | Response, payloads: Iterable[Buffer] = (),
                   prepare: Callable[[int, memoryview], object] | None = None) -> None:
        """The header, then each payload (after ``prepare(index, payload)``, if given)."""
        if isinstance(header, Request) and not header.traceparent:
            traceparent = inject_headers().get("traceparent", "")
            if traceparent:
                header = msgspec.structs.replace(header, traceparent=traceparent)
        await self._loop.sock_sendall(self.sock, encode(header))
        for i, payload in enumerate(payloads):
            if prepare is not None:  # right before it goes: the node takes in the previous one meanwhile
                payload = memoryview(payload).cast("B")
                prepare(i, payload)
            await self._loop.sock_sendall(self.sock, payload)

    async def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` completely from the socket."""
        got, total = 0, view.nbytes
        while got < total:
            n = await self._loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise ChannelClosed("peer closed the connection mid-message")
            got += n

    async def recv_header(self, limit: int = MAX_HEADER) -> bytes:
        await self.recv_into(memoryview(self._len))
        (length,) = LEN.unpack(self._len)
        if length > limit:  # NOTE: checked before allocating: a peer cannot make us hold its claim
            raise FramingError(f"header of {length} bytes exceeds {limit}")
        body = bytearray(length)
        await self.recv_into(memoryview(body))
        return bytes(body)

    async def discard(self, nbytes: int) -> None:
        """Read and drop ``nbytes`` (payloads of a request that was refused)."""
        scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
        while nbytes > 0:
            chunk = scratch[: min(nbytes, scratch.nbytes)]
            await self.recv_into(chunk)
            nbytes -= chunk.nbytes

    def close(self) -> None:
        self.sock.close()
