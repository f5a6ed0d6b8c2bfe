"""``subscriptions_live`` against a real NATS server, through a loopback proxy that keeps the bytes the client
sent in the order the server got them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest

from halfmoon.runtime.rpc import subscriptions_live


class RecordingProxy:
    """Forwards one client's connection to the server both ways; ``sent`` is what the client sent."""

    def __init__(self, server_port: int) -> None:
        self.server_port = server_port
        self.port = 0
        self.sent = bytearray()
        self._server: asyncio.Server | None = None
        self._pumps: list[asyncio.Task[None]] = []

    async def start(self) -> RecordingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.server_port)
        self._pumps += [asyncio.create_task(self._pump(client_r, server_w, self.sent)),
                        asyncio.create_task(self._pump(server_r, client_w, None))]

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: bytearray | None) -> None:
        while data := await reader.read(65536):
            if record is not None:
                record += data
            writer.write(data)
            await writer.drain()
        writer.close()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)


@pytest.fixture
async def proxy(nats_server) -> AsyncIterator[RecordingProxy]:
    recording = await RecordingProxy(nats_server.port).start()
    yield recording
    await recording.stop()


async def ignore(msg) -> None:  # type: ignore[no-untyped-def]
    return None


async def test_the_server_has_the_subscriptions_before_it_returns(proxy, namespace):
    nc = await nats.connect(f"nats://127.0.0.1:{proxy.port}")
    try:
        handshake = len(proxy.sent)
        await nc.subscribe(f"{namespace}.a", cb=ignore)
        await nc.subscribe(f"{namespace}.b", cb=ignore)
        await subscriptions_live(nc)
        sent = bytes(proxy.sent[handshake:])
        # the server answers a PING after every command before it: the last PING must follow the SUBs
        assert sent.rindex(b"PING\r\n") > sent.index(f"SUB {namespace}.b ".encode()) > sent.index(
            f"SUB {namespace}.a ".encode())
    finally:
        await nc.close()
