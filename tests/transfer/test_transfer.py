"""Data plane: batched TCP round trips, the same-host shared-memory path, typed errors,
and a block server in another process."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator

import pytest

from halfmoon.core.tiers import Tier
from halfmoon.storage.allocator import Extent
from halfmoon.storage.base import BlockNotFound
from halfmoon.storage.dram import ShmTier
from halfmoon.storage.node import NodeStore
from halfmoon.storage.nvme import DirTier
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.framing import Op, Request
from halfmoon.transfer.server import BlockServer
from halfmoon.transfer.shm import ShmTransport
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import TransferError, Transport
from tests.fixtures.dataplane import Granted
from tests.fixtures.s3 import free_ports

BLOCK = 256 << 10


def key(i: int) -> bytes:
    return hashlib.sha256(f"transfer-{i}".encode()).digest()


def blocks(n: int, start: int = 0) -> tuple[list[bytes], list[bytes]]:
    return [key(i) for i in range(start, start + n)], [os.urandom(BLOCK) for _ in range(n)]


@pytest.fixture
async def server(tmp_path) -> AsyncIterator[BlockServer]:
    store = NodeStore(ShmTier(16 << 20), DirTier(tmp_path / "nvme", 64 << 20))
    srv = BlockServer(store)
    await srv.start()
    yield srv
    await srv.stop()
    await store.close()


@pytest.fixture
async def tcp(server: BlockServer) -> AsyncIterator[TcpTransport]:
    t = TcpTransport(server.address, pool_size=2)
    yield Granted(t)  # type: ignore[misc]
    await t.close()


@pytest.fixture
async def shm(server: BlockServer) -> AsyncIterator[ShmTransport]:
    client = TransferClient()
    yield Granted(await shm_path(client, server.address))  # type: ignore[misc]
    await client.close()


async def shm_path(client: TransferClient, address: str) -> ShmTransport:
    """Same host: the fast path comes first, TCP behind it."""
    paths = await client.paths(address)
    assert [p.kind for p in paths] == ["shm", "tcp"] and isinstance(paths[0].transport, ShmTransport)
    return paths[0].transport


class TestTcpRoundTrip:
    async def test_batch_write_read_delete(self, tcp: TcpTransport, server: BlockServer) -> None:
        keys, data = blocks(8)
        await tcp.write(keys, data)
        assert [bytes(v) for v in await tcp.read(keys)] == data
        assert [bytes(v) for v in await tcp.read(keys[::-1])] == data[::-1]
        assert server.payload_bytes_in == server.payload_bytes_out // 2 == 8 * BLOCK
        assert await tcp.delete([*keys[:3], key(99)]) == 3
        with pytest.raises(BlockNotFound) as err:
            await tcp.read(keys)
        assert err.value.keys == keys[:3]

    async def test_missing_ok_returns_none_in_place(self, tcp: TcpTransport) -> None:
        keys, data = blocks(2)
        await tcp.write(keys[1:], data[1:])
        first, second = await tcp.read(keys, missing_ok=True)
        assert first is None and bytes(second) == data[1]

    async def test_lower_tier_write_and_read(self, tcp: TcpTransport, server: BlockServer) -> None:
        keys, data = blocks(2)
        await tcp.write(keys, data, tier=Tier.NVME)
        assert not await server.store.dram.contains(keys[0])
        assert [bytes(v) for v in await tcp.read(keys)] == data

    async def test_a_tier_the_node_lacks_is_refused_and_the_connection_lives(self) -> None:
        store = NodeStore(ShmTier(4 << 20))  # DRAM only
        srv = BlockServer(store)
        await srv.start()
        tcp = Granted(TcpTransport(srv.address, pool_size=1))
        try:
            keys, data = blocks(2)
            with pytest.raises(TransferError, match="tier NVME is not configured on this node"):
                await tcp.write(keys, data, tier=Tier.NVME)
            await tcp.write(keys, data)  # the same connection: the refused payload was read and dropped
            assert [bytes(v) for v in await tcp.read(keys)] == data
        finally:
            await tcp.close()
            await srv.stop()
            await store.close()

    async def test_concurrent_batches_share_the_pool(self, tcp: TcpTransport) -> None:
        batches = [blocks(4, start=10 * i) for i in range(5)]
        await asyncio.gather(*(tcp.write(k, d) for k, d in batches))
        results = await asyncio.gather(*(tcp.read(k) for k, _ in batches))
        assert [[bytes(v) for v in r] for r in results] == [d for _, d in batches]


@pytest.fixture(params=["tcp", "shm"])
async def any_transport(request: pytest.FixtureRequest, server: BlockServer) -> AsyncIterator[Transport]:
    client = TransferClient(same_host=request.param == "shm")
    t = await shm_path(client, server.address) if request.param == "shm" else await client.transport(server.address)
    assert isinstance(t, ShmTransport if request.param == "shm" else TcpTransport)
    yield Granted(t)  # type: ignore[misc]
    await client.close()


class TestReadInto:
    async def test_blocks_land_in_the_callers_buffer_in_key_order(
        self, any_transport: Transport, tcp: TcpTransport
    ) -> None:
        transport = any_transport
        keys, data = blocks(3)
        await tcp.write(keys[:1] + keys[2:], data[:1] + data[2:])
        await tcp.write(keys[1:2], data[1:2], tier=Tier.NVME)  # the shm path gets it over TCP
        dest = memoryview(bytearray(3 * BLOCK + 10))
        views = await transport.read(keys, into=dest)
        assert bytes(dest[: 3 * BLOCK]) == b"".join(data)
        assert all(v.obj is dest.obj for v in views)
        with pytest.raises(ValueError):
            await transport.read(keys, into=memoryview(bytearray(BLOCK)))
        assert [bytes(v) for v in await transport.read(keys)] == data  # the transport still works


class TestSharedMemoryPath:
    async def test_bytes_bypass_the_socket(self, shm: ShmTransport, tcp: TcpTransport, server: BlockServer) -> None:
        keys, data = blocks(6)
        await shm.write(keys, data)
        assert [bytes(v) for v in await shm.read(keys)] == data
        assert server.payload_bytes_in == server.payload_bytes_out == 0
        assert [bytes(v) for v in await tcp.read(keys)] == data  # the node serves them to others too

    async def test_manager_chosen_offsets_are_used(self, shm: ShmTransport, server: BlockServer) -> None:
        keys, data = blocks(2)
        offsets = [4 * BLOCK, BLOCK]
        await shm.write(keys, data, offsets=offsets)
        assert [server.store.dram.locate(k).offset for k in keys] == offsets
        assert server.requests == {Op.HELLO: 1, Op.COMMIT: 1}  # no RESERVE: the offsets were known
        extents = [Extent(o, BLOCK) for o in offsets]  # what a lookup's DRAM replicas say
        assert [bytes(v) for v in await shm.read(keys, extents=extents)] == data
        assert Op.LOCATE not in server.requests  # read without asking the node
        assert [bytes(v) for v in await shm.read(keys)] == data
        assert server.requests[Op.LOCATE] == 1

    async def test_blocks_outside_dram_come_over_tcp(self, shm: ShmTransport, server: BlockServer) -> None:
        keys, data = blocks(3)
        await shm.write(keys[:2], data[:2])
        await shm.write(keys[2:], data[2:], tier=Tier.NVME)
        assert [bytes(v) for v in await shm.read(keys)] == data
        assert server.payload_bytes_out == BLOCK  # only the NVMe block crossed the socket
        with pytest.raises(BlockNotFound):
            await shm.read([key(1234)])


class TestNodeRestart:
    async def test_same_host_client_detects_a_replaced_segment(self) -> None:
        first = NodeStore(ShmTier(4 << 20))
        srv = BlockServer(first)
        await srv.start()
        host, port = srv.address.split(":")
        client = TransferClient()
        old = Granted(await client.transport(srv.address))
        old_shm = Granted(await shm_path(client, srv.address))
        await srv.stop()
        await first.close()  # unlinks the segment the client still maps
        second = NodeStore(ShmTier(4 << 20))
        restarted = BlockServer(second, host, int(port))
        await restarted.start()
        keys, data = blocks(2)
        with pytest.raises(TransferError, match="gone"):
            await old_shm.write(keys[:1], data[:1])  # would have written into orphaned memory
        await old.write(keys[:1], data[:1])  # a transport taken before the restart fails over to TCP
        assert old.last_kind == "tcp" and second.dram.find(keys[0]) is not None
        new = Granted(await client.transport(restarted.address))
        assert new.inner is not old.inner and isinstance(new.paths[0].transport, ShmTransport)
        await new.write(keys[1:], data[1:])
        assert new.last_kind == "shm" and bytes(second.dram.view(keys[1])) == data[1]
        await client.close()
        await restarted.stop()
        await second.close()


class TestErrors:
    async def test_unreachable_node_is_transfer_error(self) -> None:
        (port,) = free_ports(1)
        t = TcpTransport(f"127.0.0.1:{port}")
        with pytest.raises(TransferError):
            await t.read([key(0)])

    async def test_silent_node_times_out_as_transfer_error(self) -> None:
        with socket.create_server(("127.0.0.1", 0)) as mute:  # accepts connections, never answers
            t = TcpTransport(f"127.0.0.1:{mute.getsockname()[1]}", timeout_s=0.3)
            with pytest.raises(TransferError, match="TimeoutError"):
                await t.read([key(0)])
            await t.close()

    async def test_full_tier_rejects_only_what_does_not_fit(self, tcp: TcpTransport) -> None:
        small, huge = os.urandom(BLOCK), os.urandom(20 << 20)  # segment is 16 MiB
        with pytest.raises(TransferError, match="1 block"):
            await tcp.write([key(1), key(2), key(3)], [small, huge, small])
        assert [bytes(v) for v in await tcp.read([key(1), key(3)])] == [small, small]

    async def test_bad_batch_is_refused_before_sending(self, tcp: TcpTransport) -> None:
        with pytest.raises(ValueError):
            await tcp.write([key(1)], [b"a", b"b"])
        with pytest.raises(ValueError):
            await tcp.write([b"short"], [b"a"])

    async def test_garbage_frame_closes_only_that_connection(self, tcp: TcpTransport, server: BlockServer) -> None:
        host, port = server.address.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"\x05\x00\x00\x00hello")
        assert await asyncio.wait_for(reader.read(1), timeout=10) == b""  # the server hung up on it
        writer.close()
        keys, data = blocks(1)
        await tcp.write(keys, data)
        assert bytes((await tcp.read(keys))[0]) == data[0]


SERVER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from halfmoon.storage.dram import ShmTier
    from halfmoon.storage.node import NodeStore
    from halfmoon.transfer.server import BlockServer

    async def main():
        store = NodeStore(ShmTier(16 << 20))
        server = BlockServer(store)
        await server.start()
        print(server.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop()
        await store.close()

    asyncio.run(main())
    """
)


class TestAcrossProcesses:
    async def test_tcp_and_shm_against_a_server_process(self) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", SERVER_SCRIPT, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            address = (await proc.stdout.readline()).decode().strip()
            keys, data = blocks(4)
            tcp = Granted(TcpTransport(address))
            client = TransferClient()
            shm = Granted(await shm_path(client, address))
            await tcp.write(keys[:2], data[:2])
            await shm.write(keys[2:], data[2:])
            assert [bytes(v) for v in await shm.read(keys)] == data
            assert [bytes(v) for v in await tcp.read(keys)] == data
            await tcp.close()
            await client.close()
        finally:
            proc.stdin.close()
            assert await asyncio.wait_for(proc.wait(), 20) == 0


class TestAbandonedReservation:
    async def test_reservation_is_released_when_the_client_disconnects(self, server: BlockServer) -> None:
        client = Granted(TcpTransport(server.address))
        resp = await client.request(Request(Op.RESERVE, [key(1)], [12 << 20]))
        assert resp.ok and server.store.dram.is_reserved(key(1))
        assert (await server.store.dram.usage()).used >= 12 << 20
        await client.close()  # disconnect without COMMIT
        probe = Granted(TcpTransport(server.address))
        deadline = asyncio.get_running_loop().time() + 10
        while server.store.dram.is_reserved(key(1)):  # the server notices the hang-up
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0)  # yield to the server task; no timed wait
        keys, data = [key(2)], [os.urandom(12 << 20)]
        await probe.write(keys, data)  # the room is free again
        await probe.close()
