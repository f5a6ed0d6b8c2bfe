"""TCP transport: batched reads and writes over a small pool of connections to one node."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from halfmoon.core.cluster_keys import DEV_KEYS, ClusterKeys
from halfmoon.storage.base import Buffer
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.auth import authenticate_to_node
from halfmoon.transfer.channel import Channel
from halfmoon.transfer.framing import FramingError, Op, Request, Response, decode_response
from halfmoon.transfer.transport import BlockHook, ReadBatch, TransferError, Transport, WriteBatch, block_views

_READ = METRICS.transfer_bytes.labels("tcp", "read")
_WRITTEN = METRICS.transfer_bytes.labels("tcp", "write")


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return host, int(port)


class TcpTransport(Transport):
    """``timeout_s`` bounds each whole request (connect, send, reply); a node that does not
    answer in time is a ``TransferError`` like one that cannot be reached, and so is one that
    fails the handshake (``keys``: the cluster's)."""

    def __init__(self, address: str, pool_size: int = 4, timeout_s: float = 30.0,
                 keys: ClusterKeys = DEV_KEYS) -> None:
        if pool_size < 1 or timeout_s <= 0:
            raise ValueError("pool_size must be >= 1 and timeout_s > 0")
        self.address = address
        self.timeout_s = timeout_s
        self._host, self._port = parse_address(address)
        self._handshake_key = keys.handshake
        self._idle: list[Channel] = []
        self._slots = asyncio.Semaphore(pool_size)

    @asynccontextmanager
    async def _channel(self) -> AsyncIterator[Channel]:
        async with self._slots:
            try:
                async with asyncio.timeout(self.timeout_s):
                    ch = self._idle_channel() or await self._connect()
                    try:
                        yield ch
                    except BaseException:
                        ch.close()  # the stream may be mid-message: never reuse it
                        raise
            except (OSError, FramingError) as exc:  # TimeoutError and AuthError are OSErrors
                raise TransferError(f"{self.address}: {type(exc).__name__}: {exc}") from exc
            self._idle.append(ch)

    def _idle_channel(self) -> Channel | None:
        while self._idle:
            ch = self._idle.pop()
            if not ch.peer_gone():
                return ch
            ch.close()
        return None

    async def _connect(self) -> Channel:
        ch = await Channel.connect(self._host, self._port)
        try:
            await authenticate_to_node(ch, self._handshake_key)
        except BaseException:
            ch.close()
            raise
        return ch

    async def request(self, req: Request, payloads: Sequence[Buffer] = (),
                      prepare: BlockHook | None = None) -> Response:
        """One control round trip (no payloads expected back)."""
        async with self._channel() as ch:
            await ch.send(req, payloads, prepare)
            return decode_response(await ch.recv_header())

    async def _read(self, batch: ReadBatch) -> list[memoryview | None]:
        async with self._channel() as ch:
            await ch.send(Request(Op.READ, list(batch.keys), caps=list(batch.caps)))
            resp = decode_response(await ch.recv_header())
            if not resp.ok or len(resp.sizes) != len(batch.keys):
                raise TransferError(f"{self.address}: read refused: {resp.error}")
            buf, views = block_views(batch.into, resp.sizes)  # MISSING sizes are negative
            if batch.check is None:
                await ch.recv_into(buf)
            else:  # block by block: each is checked while the next one arrives
                for i, view in enumerate(views):
                    if view is not None:
                        await ch.recv_into(view)
                        batch.check(i, view)
        _READ.inc(buf.nbytes)
        return views

    async def _write(self, batch: WriteBatch) -> None:
        req = Request(Op.WRITE, list(batch.keys), batch.sizes, list(batch.offsets or ()), int(batch.tier),
                      caps=list(batch.caps))
        resp = await self.request(req, batch.payloads, batch.prepare)
        if not resp.ok:
            raise TransferError(f"{self.address}: {len(resp.keys)} block(s) not stored: {resp.error}")
        _WRITTEN.inc(sum(batch.sizes))

    async def delete(self, keys: Sequence[bytes], *, caps: Sequence[bytes] = ()) -> int:
        resp = await self.request(Request(Op.DELETE, list(keys), caps=list(caps)))
        if not resp.ok:
            raise TransferError(f"{self.address}: delete refused: {resp.error}")
        return resp.count

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
