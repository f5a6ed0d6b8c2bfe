"""TCP block server: a node's tiers on the data plane, serving batched reads and writes.

Every connection first proves it knows the cluster secret (transfer/auth.py), and every
block operation carries capabilities checked before a byte is read or allocated
(transfer/capability.py). Connections are bounded in number, header size and idle time.

Writes to DRAM are received straight into the shared-memory segment at the reserved offset;
reads from DRAM are sent straight from it. Same-host clients use LOCATE/RESERVE/COMMIT and
move the bytes themselves through the segment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import Counter
from collections.abc import Callable, Coroutine
from functools import cache
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from halfmoon.core.cluster_keys import DEV_KEYS, ClusterKeys
from halfmoon.core.keys import key_hex
from halfmoon.core.tiers import Tier
from halfmoon.storage.base import BlockNotFound, StorageError
from halfmoon.storage.node import NodeStore
from halfmoon.telemetry import extract_context
from halfmoon.transfer.auth import AuthError, authenticate_peer
from halfmoon.transfer.capability import CapabilityChecker, CapabilityError, authorize
from halfmoon.transfer.channel import Channel, ChannelClosed
from halfmoon.transfer.framing import (
    MAX_KEYS,
    MISSING,
    NO_OFFERS,
    FramingError,
    Offers,
    Op,
    Request,
    Response,
    decode_request,
)

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("halfmoon.transfer")
MAX_BLOCK = 1 << 30


@cache
def host_identity() -> str:
    """Equal on two processes exactly when they share a kernel (and so /dev/shm, normally)."""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        return f"{socket.gethostname()}/{f.read().strip()}"
    return socket.gethostname()


class BadRequest(ValueError):
    pass


# the node's side of CONNECT: a client's RDMA endpoint (msgpack) -> the node's, with its segment
Accept = Callable[[bytes], bytes]


class BlockServer:
    """``node_id`` is the id capabilities must name; ``keys`` the cluster's (the public
    development keys by default: tests and benchmarks). ``offers`` are the paths beyond TCP and
    shared memory HELLO announces; ``accept`` answers CONNECT (set exactly when RDMA is offered)."""

    def __init__(self, store: NodeStore, host: str = "127.0.0.1", port: int = 0, *, node_id: str = "node",
                 keys: ClusterKeys = DEV_KEYS, max_connections: int = 256, idle_timeout_s: float = 300.0,
                 offers: Offers = NO_OFFERS, accept: Accept | None = None) -> None:
        if max_connections < 1 or idle_timeout_s <= 0:
            raise ValueError("max_connections must be >= 1 and idle_timeout_s > 0")
        if (accept is not None) != (offers.rdma is not None):
            raise ValueError("an RDMA offer needs an accept function, and only it")
        self.store = store
        self.offers, self._accept = offers, accept
        self._bind = (host, port)
        self._handshake_key = keys.handshake
        self.checker = CapabilityChecker(node_id, keys.grant, keys.park)
        self.max_connections, self.idle_timeout_s = max_connections, idle_timeout_s
        self.refused_connections = 0  # over max_connections, or failed the handshake
        self.refused_requests = 0  # without a capability that covers them
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._channels: set[Channel] = set()
        self.payload_bytes_in = 0  # bytes of blocks received over sockets (not via shared memory)
        self.payload_bytes_out = 0
        self.requests: Counter[Op] = Counter()

    @property
    def address(self) -> str:
        assert self._listener is not None, "server not started"
        host, port = self._listener.getsockname()
        return f"{host}:{port}"

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(self._bind)
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self._spawn(self._accept_loop(sock))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(listener)
            if len(self._channels) >= self.max_connections:
                self.refused_connections += 1
                conn.close()  # before reading anything: a flood costs a socket, never a buffer
                continue
            ch = Channel(conn)
            self._channels.add(ch)
            self._spawn(self._serve(ch))

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for ch in list(self._channels):
            ch.close()

    async def _serve(self, ch: Channel) -> None:
        reserved: set[bytes] = set()  # in-place writes this client has not committed yet
        try:
            await authenticate_peer(ch, self._handshake_key)
            while True:
                async with asyncio.timeout(self.idle_timeout_s):
                    header = await ch.recv_header()
                await self._handle(ch, decode_request(header), reserved)
        except ChannelClosed:
            pass
        except AuthError as exc:
            self.refused_connections += 1
            log.warning("refused an unauthenticated connection: %s", exc)
        except (FramingError, CapabilityError, OSError) as exc:  # TimeoutError (idle) is an OSError
            log.warning("closing connection after %s", exc)
        finally:
            for key in reserved:  # the client went away mid-write: its room is free again
                self.store.dram.abort(key)
            self._channels.discard(ch)
            ch.close()

    async def _handle(self, ch: Channel, req: Request, reserved: set[bytes]) -> None:
        self.requests[req.op] += 1
        try:
            _validate(req)
        except BadRequest as exc:
            if req.op is Op.WRITE:  # its payload follows, sized by a header we cannot trust: never read it
                raise FramingError(f"unrecoverable write request: {exc}") from None
            await ch.send(Response(False, error=f"bad request: {exc}"))
            return
        try:
            authorize(self.checker, req)
        except CapabilityError as exc:
            self.refused_requests += 1
            if req.op is Op.WRITE:  # its payload follows: read it into scratch (never allocated), drop it
                await ch.discard(sum(req.sizes))
            await ch.send(Response(False, error=f"forbidden: {exc}"))
            return
        context = extract_context({"traceparent": req.traceparent}) if req.traceparent else None
        with _tracer.start_as_current_span(f"transfer.{req.op.name.lower()}", context=context,
                                           kind=SpanKind.SERVER) as span:
            span.set_attribute("halfmoon.blocks", len(req.keys))
            if req.op is Op.READ:
                await self._read(ch, req)
            elif req.op is Op.WRITE:
                span.set_attribute("halfmoon.bytes", sum(req.sizes))
                await self._write(ch, req)
            else:
                await ch.send(await self._control(req, reserved))

    async def _read(self, ch: Channel, req: Request) -> None:
        payloads, sizes = [], []
        for key in req.keys:
            try:
                data = await self.store.read(key)
            except BlockNotFound:
                sizes.append(MISSING)
                continue
            payloads.append(data)
            sizes.append(memoryview(data).nbytes)
        await ch.send(Response(True, sizes=sizes), payloads)
        self.payload_bytes_out += sum(s for s in sizes if s != MISSING)

    async def _write(self, ch: Channel, req: Request) -> None:
        if Tier(req.tier) not in self.store.tiers:  # its payload follows: read it into scratch, drop it
            await ch.discard(sum(req.sizes))
            await ch.send(Response(False, error=f"tier {Tier(req.tier).name} is not configured on this node",
                                   keys=list(req.keys), count=0))
            return
        failed, errors = [], []
        dram = self.store.dram
        for i, (key, size) in enumerate(zip(req.keys, req.sizes)):
            offset = req.offsets[i] if req.offsets else None
            try:
                if req.tier == Tier.DRAM:
                    ext = dram.reserve(key, size, offset)
                    try:
                        await ch.recv_into(dram.writable(ext))
                    except BaseException:
                        dram.abort(key)
                        raise
                    dram.commit(key)
                else:
                    buf = bytearray(size)
                    await ch.recv_into(memoryview(buf))
                    await self.store.write(key, buf, Tier(req.tier))
            except (StorageError, ValueError) as exc:
                if req.tier == Tier.DRAM:
                    await ch.discard(size)  # refused before the bytes were read
                failed.append(key)
                errors.append(f"{key_hex(key)}: {type(exc).__name__}: {exc}")
            self.payload_bytes_in += size
        await ch.send(Response(not failed, error="; ".join(errors[:4]), keys=failed, count=len(req.keys) - len(failed)))

    def capacities(self) -> list[int]:
        """Configured bytes per tier, DRAM first; S3's is its configured quota (no listing)."""
        out = [0] * len(Tier)
        for tier, store in self.store.tiers.items():
            out[tier] = store.capacity
        return out

    async def _control(self, req: Request, reserved: set[bytes]) -> Response:
        dram = self.store.dram
        if req.op is Op.HELLO:
            return Response(True, segment=dram.segment, host=host_identity(), capacities=self.capacities(),
                            offers=self.offers)
        if req.op is Op.CONNECT:
            if self._accept is None:
                return Response(False, error="this node offers no RDMA path")
            try:
                return Response(True, endpoint=self._accept(req.endpoint))
            except (ValueError, RuntimeError, OSError) as exc:  # a bad endpoint, or the device refused it
                return Response(False, error=f"RDMA connect refused: {type(exc).__name__}: {exc}")
        if req.op is Op.LOCATE:
            exts = [dram.find(k) for k in req.keys]
            return Response(
                True,
                offsets=[e.offset if e else MISSING for e in exts],
                sizes=[e.size if e else MISSING for e in exts],
            )
        if req.op is Op.RESERVE:
            try:  # one allocation for the batch: per-block bookkeeping is what small blocks cost
                reservations = dram.reserve_batch(req.keys, req.sizes, req.offsets or None)
            except (StorageError, ValueError) as exc:
                return Response(False, error=f"{type(exc).__name__}: {exc}")
            reserved.update(req.keys)
            return Response(True, offsets=[e.offset for e in reservations], sizes=[e.size for e in reservations])
        if req.op is Op.COMMIT:
            if req.sizes:  # written in place at offsets the cache-manager chose: claim them now
                claimed = await self._control(Request(Op.RESERVE, req.keys, req.sizes, req.offsets), reserved)
                if not claimed.ok:
                    return claimed
            missing = dram.commit_batch(req.keys)
            reserved.difference_update(req.keys)
            return Response(not missing, error=f"{len(missing)} key(s) were not reserved", keys=missing,
                            count=len(req.keys) - len(missing))  # fmt: skip
        if req.op is Op.DELETE:
            return Response(True, count=sum([await self.store.delete(k) for k in req.keys]))
        inventory = await self.store.inventory()
        return Response(
            True,
            keys=[b.key for b in inventory],
            tiers=[int(b.tier) for b in inventory],
            offsets=[b.offset for b in inventory],
            sizes=[b.size for b in inventory],
        )


def _validate(req: Request) -> None:
    if req.op is Op.AUTH:
        raise BadRequest("the connection is already authenticated")
    if len(req.keys) > MAX_KEYS:
        raise BadRequest(f"at most {MAX_KEYS} keys per request")
    if any(len(k) != 32 for k in req.keys):
        raise BadRequest("keys must be 32 bytes")
    if req.op in (Op.WRITE, Op.RESERVE) or (req.op is Op.COMMIT and req.sizes):
        if len(req.sizes) != len(req.keys):
            raise BadRequest(f"{len(req.keys)} keys but {len(req.sizes)} sizes")
        if any(not 0 < s <= MAX_BLOCK for s in req.sizes):
            raise BadRequest(f"block sizes must be in 1..{MAX_BLOCK}")
        if req.offsets and len(req.offsets) != len(req.keys):
            raise BadRequest(f"{len(req.keys)} keys but {len(req.offsets)} offsets")
        if req.tier not in tuple(Tier):
            raise BadRequest(f"unknown tier {req.tier}")
