"""Choosing transports per peer and failing over: the next path to the same node, then another replica.

Real block servers on loopback; a path or replica fails because its server is stopped or its
Mooncake engine is gone, never because a fake says so."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest

from halfmoon.storage.base import BlockNotFound
from halfmoon.storage.dram import ShmTier
from halfmoon.storage.node import NodeStore
from halfmoon.transfer.chooser import path_kinds
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.failover import (
    BatchSource,
    FailoverReader,
    Path,
    PathHealth,
    attempt_order,
)
from halfmoon.transfer.framing import Offers
from halfmoon.transfer.server import BlockServer
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import TransferError
from tests.fixtures.dataplane import Granted, caps
from tests.transfer.test_transfer import blocks


class TestPathChoice:
    def test_paths_both_ends_have_fastest_first_and_tcp_always_last(self) -> None:
        both = {"rdma", "mooncake"}
        assert path_kinds(both, both, same_host=True) == ["shm", "rdma", "mooncake", "tcp"]
        assert path_kinds({"mooncake"}, {"rdma", "mooncake"}, same_host=False) == ["mooncake", "tcp"]
        assert path_kinds({"rdma"}, {"mooncake"}, same_host=False) == ["tcp"]
        assert path_kinds(set(), set(), same_host=True) == ["shm", "tcp"]

    def test_offers_name_the_paths_a_node_has(self) -> None:
        assert Offers().kinds() == set()
        assert Offers(mooncake={"session": "h:1", "segment_addr": 0, "segment_size": 1}).kinds() == {"mooncake"}


class TestPathHealth:
    def test_a_failed_path_cools_down_for_doubling_periods_and_recovers(self) -> None:
        health = PathHealth(cooldown_s=1.0, max_cooldown_s=3.0)
        health.failed("a", "rdma", now=10.0)
        assert not health.healthy("a", "rdma", 10.5) and health.healthy("a", "rdma", 11.0)
        health.failed("a", "rdma", now=11.0)  # second failure in a row: 2 s
        assert not health.healthy("a", "rdma", 12.9) and health.healthy("a", "rdma", 13.0)
        health.failed("a", "rdma", now=13.0)  # 4 s, capped at 3
        assert health.healthy("a", "rdma", 16.0)
        health.succeeded("a", "rdma")
        assert health.healthy("a", "rdma", 0.0) and health.healthy("a", "tcp", 0.0)

    def test_cooling_paths_are_tried_last_never_dropped(self) -> None:
        health = PathHealth()
        health.failed("a", "rdma", now=0.0)
        reps = [BatchSource("a"), BatchSource("b")]
        order = attempt_order(reps, lambda _: ["rdma", "tcp"], health, now=0.1)
        assert order == [(0, "tcp"), (1, "rdma"), (1, "tcp"), (0, "rdma")]


async def start_server() -> BlockServer:
    srv = BlockServer(NodeStore(ShmTier(8 << 20)))
    await srv.start()
    return srv


@pytest.fixture
async def servers() -> AsyncIterator[list[BlockServer]]:
    started = [await start_server(), await start_server()]
    yield started
    for srv in started:
        await srv.stop()
        await srv.store.close()


def tcp_paths() -> tuple[dict[str, TcpTransport], FailoverReader]:
    opened: dict[str, TcpTransport] = {}

    async def paths(address: str) -> list[Path]:
        opened.setdefault(address, TcpTransport(address, timeout_s=5.0))
        return [Path("tcp", opened[address])]

    return opened, FailoverReader(paths)


async def write(address: str, keys: list[bytes], data: list[bytes]) -> None:
    t = TcpTransport(address)
    await t.write(keys, data, caps=caps(keys))
    await t.close()


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed on exit: nothing listens there


class TestReplicaFailover:
    async def test_a_dead_replica_is_skipped_and_remembered(self, servers: list[BlockServer]) -> None:
        keys, data = blocks(4)
        opened, reader = tcp_paths()
        for srv in servers:
            await write(srv.address, keys, data)
        first, second = servers
        replicas = [BatchSource(first.address), BatchSource(second.address)]
        await first.stop()
        assert [bytes(v) for v in await reader.read(keys, replicas, caps=lambda _: caps(keys))] == data
        assert [(a, o == "ok") for a, _, o in reader.attempts] == [(r.address, r is replicas[1]) for r in replicas]
        await reader.read(keys, replicas, caps=lambda _: caps(keys))  # the failed replica waits out its cool-down
        assert [a for a, *_ in reader.attempts] == [replicas[1].address]
        for t in opened.values():
            await t.close()

    async def test_a_replica_that_lost_the_blocks_hands_over_to_one_that_has_them(
        self, servers: list[BlockServer]
    ) -> None:
        keys, data = blocks(3)
        opened, reader = tcp_paths()
        await write(servers[1].address, keys, data)
        views = await reader.read(keys, [BatchSource(servers[0].address), BatchSource(servers[1].address)],
                                  caps=lambda _: caps(keys))
        assert [bytes(v) for v in views] == data
        with pytest.raises(BlockNotFound):
            await reader.read(keys, [BatchSource(servers[0].address)], caps=lambda _: caps(keys))
        for t in opened.values():
            await t.close()

    async def test_when_every_replica_fails_the_error_names_each(self) -> None:
        _, reader = tcp_paths()
        replicas = [BatchSource(dead_address()), BatchSource(dead_address())]
        with pytest.raises(TransferError) as err:
            await reader.read(blocks(1)[0], replicas)
        assert all(r.address in str(err.value) for r in replicas)


def mooncake_engine():  # type: ignore[no-untyped-def]
    from halfmoon.transfer.mooncake import MooncakeEngine, MooncakeUnavailable

    try:
        return MooncakeEngine()
    except MooncakeUnavailable as exc:
        pytest.skip(str(exc))


async def offering(offers: Offers) -> BlockServer:
    srv = BlockServer(NodeStore(ShmTier(8 << 20)), offers=offers)
    await srv.start()
    return srv


class TestClientPaths:
    async def test_a_same_host_node_gets_shared_memory_then_tcp_both_working(self, servers: list[BlockServer]) -> None:
        client = TransferClient()
        keys, data = blocks(2)
        await write(servers[0].address, keys, data)
        paths = await client.paths(servers[0].address)
        assert [p.kind for p in paths] == ["shm", "tcp"]
        for p in paths:
            assert [bytes(v) for v in await p.transport.read(keys, caps=caps(keys))] == data
        assert await client.paths(servers[0].address) is paths  # cached per node
        await client.close()

    async def test_paths_the_node_does_not_offer_are_not_opened(self, servers: list[BlockServer]) -> None:
        from halfmoon.transfer.mooncake import mooncake_opener

        client = TransferClient(same_host=False, openers=[mooncake_opener(mooncake_engine())])
        assert [p.kind for p in await client.paths(servers[0].address)] == ["tcp"]  # no offer in its HELLO
        await client.close()

    async def test_a_path_that_cannot_open_is_left_out_with_the_reason(self) -> None:
        from halfmoon.transfer.mooncake import mooncake_opener

        srv = await offering(Offers(mooncake={"session": 5}))  # a malformed offer
        client = TransferClient(same_host=False, openers=[mooncake_opener(mooncake_engine())])
        assert [p.kind for p in await client.paths(srv.address)] == ["tcp"]
        assert "ValidationError" in client.open_errors[(srv.address, "mooncake")]
        await client.close()
        await srv.stop()
        await srv.store.close()

    async def test_connect_is_refused_by_a_node_without_rdma(self, servers: list[BlockServer]) -> None:
        from halfmoon.transfer.framing import Op, Request

        tcp = TcpTransport(servers[0].address)
        answer = await tcp.request(Request(Op.CONNECT, endpoint=b"\x80"))
        assert not answer.ok and "no RDMA" in answer.error
        await tcp.close()


class TestRdmaConnect:
    """The queue-pair exchange over the node's control connection (the device's part needs an RNIC)."""

    async def test_endpoints_are_swapped_and_a_bad_one_is_refused_with_the_reason(self) -> None:
        import msgspec

        from halfmoon.transfer.rdma import RdmaEndpoint, exchange_over_control

        node_end = RdmaEndpoint(qpn=7, psn=1, lid=0, gid="fe80::1", mtu=4, segment_addr=4096, segment_rkey=9,
                                segment_size=8 << 20)
        heard: list[RdmaEndpoint] = []

        def accept(wire: bytes) -> bytes:
            try:
                heard.append(msgspec.msgpack.decode(wire, type=RdmaEndpoint))
            except msgspec.DecodeError as exc:
                raise ValueError(str(exc)) from None
            return msgspec.msgpack.encode(node_end)

        srv = BlockServer(NodeStore(ShmTier(8 << 20)), offers=Offers(rdma={"device": "mlx5_0"}), accept=accept)
        await srv.start()
        control = TcpTransport(srv.address)
        mine = RdmaEndpoint(qpn=3, psn=2, lid=0, gid="fe80::2", mtu=4)
        assert await exchange_over_control(control, mine) == node_end and heard == [mine]
        from halfmoon.transfer.framing import Op, Request

        refused = await control.request(Request(Op.CONNECT, endpoint=b"junk"))
        assert not refused.ok and "RDMA connect refused: ValueError" in refused.error
        await control.close()
        await srv.stop()
        await srv.store.close()

    async def test_an_rdma_offer_and_an_accept_function_go_together(self) -> None:
        store = NodeStore(ShmTier(1 << 20))
        with pytest.raises(ValueError, match="accept"):
            BlockServer(store, offers=Offers(rdma={"device": "mlx5_0"}))
        with pytest.raises(ValueError, match="accept"):
            BlockServer(store, accept=lambda wire: wire)
        await store.close()


class TestPathFailover:
    async def test_a_node_whose_mooncake_engine_is_gone_is_read_and_written_over_tcp(self) -> None:
        from halfmoon.transfer.mooncake import mooncake_opener

        engine = mooncake_engine()
        srv = await offering(Offers(mooncake={"session": dead_address(), "segment_addr": 1 << 40,
                                              "segment_size": 8 << 20}))
        client = TransferClient(same_host=False, openers=[mooncake_opener(engine)])
        node = Granted(await client.transport(srv.address))
        assert [p.kind for p in node.paths] == ["mooncake", "tcp"]
        keys, data = blocks(2)
        await node.write(keys, data)
        assert node.last_kind == "tcp" and srv.payload_bytes_in == sum(map(len, data))  # over the socket
        assert not client.health.healthy(srv.address, "mooncake", node._clock())
        assert [bytes(v) for v in await node.read(keys)] == data  # mooncake cooling down: TCP straight away
        assert node.last_kind == "tcp"
        reader = FailoverReader(client.paths)  # a reader without that memory: mooncake first, then TCP
        views = await reader.read(keys, [BatchSource(srv.address)], caps=lambda _: caps(keys))
        assert [bytes(v) for v in views] == data
        assert [(k, o == "ok") for _, k, o in reader.attempts] == [("mooncake", False), ("tcp", True)]
        await client.close()
        await srv.stop()
        await srv.store.close()

    async def test_when_every_path_fails_the_error_names_each(self) -> None:
        from halfmoon.transfer.failover import PathFailover

        node = PathFailover("n", [Path("shm", TcpTransport(dead_address())), Path("tcp", TcpTransport(dead_address()))])
        with pytest.raises(TransferError, match=r"every path failed: shm: .*; tcp: "):
            await node.read(blocks(1)[0])
        await node.close()
