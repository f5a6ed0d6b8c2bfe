"""What one HTTP client may hold of the gateway: a request body that stops arriving is cut off, and one
address holds a bounded number of connections, so a slow or greedy client cannot tie up the server."""

from __future__ import annotations

import asyncio
from collections import Counter

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol


class BodyIdle(Exception):
    """The client sent no byte of its request body for longer than the idle limit."""


class BodyIdleTimeout:
    """ASGI middleware: every read of the request body waits at most ``idle_s`` for the next chunk,
    then raises :class:`BodyIdle` (the app answers 408 and closes the connection)."""

    def __init__(self, app: ASGIApp, idle_s: float) -> None:
        self.app, self.idle_s = app, idle_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False

        async def bounded_receive() -> Message:
            nonlocal body_done
            if body_done:  # afterwards the app only waits for the client to leave, as long as it streams
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.idle_s)
            except TimeoutError:
                raise BodyIdle(f"no request body byte for {self.idle_s:g} s") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, bounded_receive, send)


def per_client_protocol(max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol, refusing a client address's connection beyond ``max_connections`` open
    ones (answered 503 and closed at once); the count is shared by every connection of this server."""
    open_by_client: Counter[str] = Counter()
    refusal = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 29\r\n"
               b"connection: close\r\n\r\ntoo many connections from you")

    class PerClientH11Protocol(H11Protocol):
        _counted: str | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # narrows BaseTransport as uvicorn's own does
            peer = transport.get_extra_info("peername")
            client = str(peer[0]) if peer else ""
            if open_by_client[client] >= max_connections:
                transport.write(refusal)
                transport.close()
                return
            open_by_client[client] += 1
            self._counted = client
            super().connection_made(transport)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._counted is None:
                return  # refused in connection_made: uvicorn never knew it
            open_by_client[self._counted] -= 1
            if not open_by_client[self._counted]:
                del open_by_client[self._counted]
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._counted is not None:
                super().data_received(data)

        def eof_received(self) -> None:
            if self._counted is not None:
                super().eof_received()

    return PerClientH11Protocol
