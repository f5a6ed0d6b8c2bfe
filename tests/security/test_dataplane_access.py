"""Who may touch a transfer node: the handshake keyed by the cluster secret, then a capability per block."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
import tracemalloc

import msgspec
import pytest

from halfmoon.core.cluster_keys import DEV_KEYS, ClusterKeys
from halfmoon.core.keys import handoff_key
from halfmoon.core.tiers import Tier
from halfmoon.storage.dram import ShmTier
from halfmoon.storage.node import NodeStore
from halfmoon.transfer.auth import authenticate_to_node
from halfmoon.transfer.capability import CapabilityChecker, CapabilityError, Right, sign_park
from halfmoon.transfer.channel import Channel, ChannelClosed
from halfmoon.transfer.framing import LEN, Op, Request, decode_response, encode
from halfmoon.transfer.server import BlockServer
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import TransferError
from tests.fixtures.dataplane import cap, caps
from tests.security.dataplane_node import KEYS, NODE, node  # noqa: F401  (fixture)

BLOCK = 64 << 10


def key(i: int) -> bytes:
    return hashlib.sha256(f"sec-{i}".encode()).digest()


async def store_one(node: BlockServer, k: bytes, data: bytes) -> None:
    tcp = TcpTransport(node.address, keys=KEYS)
    await tcp.write([k], [data], caps=caps([k], node=NODE, keys=KEYS))
    await tcp.close()


class TestWithoutTheSecret:
    @pytest.mark.parametrize("other", [DEV_KEYS, ClusterKeys.from_secret(b"another-cluster-secret-xyz")])
    async def test_every_operation_is_refused_at_the_handshake(self, node: BlockServer, other: ClusterKeys) -> None:
        await store_one(node, key(1), os.urandom(BLOCK))
        # even with capabilities signed by the right grant key: the connection itself is refused
        granted = caps([key(1)], node=NODE, keys=KEYS)
        intruder = TcpTransport(node.address, keys=other)
        with pytest.raises(TransferError, match="AuthError"):
            await intruder.read([key(1)], caps=granted)
        with pytest.raises(TransferError, match="AuthError"):
            await intruder.write([key(2)], [os.urandom(BLOCK)], caps=granted)
        with pytest.raises(TransferError, match="AuthError"):
            await intruder.request(Request(Op.INVENTORY, caps=[cap(b"", node=NODE, keys=KEYS)]))
        with pytest.raises(TransferError, match="AuthError"):
            await intruder.delete([key(1)], caps=granted)
        await intruder.close()
        assert await node.store.dram.contains(key(1)) and not await node.store.dram.contains(key(2))

    async def test_a_request_before_the_handshake_gets_only_a_refusal(self, node: BlockServer) -> None:
        host, port = node.address.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(encode(Request(Op.HELLO)))
        (length,) = LEN.unpack(await reader.readexactly(LEN.size))
        reply = decode_response(await reader.readexactly(length))
        assert not reply.ok and "unauthenticated" in reply.error and not reply.segment and not reply.host
        assert await asyncio.wait_for(reader.read(1), timeout=10) == b""  # and the node hangs up
        writer.close()


class TestWithoutACapability:
    @pytest.fixture
    async def peer(self, node: BlockServer):  # type: ignore[no-untyped-def]
        tcp = TcpTransport(node.address, keys=KEYS)
        yield tcp
        await tcp.close()

    async def test_reads_need_a_valid_capability_for_the_key(self, node: BlockServer, peer: TcpTransport) -> None:
        await store_one(node, key(1), data := os.urandom(BLOCK))
        good = cap(key(1), Right.READ, NODE, keys=KEYS)
        body = good[:-16]
        refused = {
            "none": b"",
            "expired": cap(key(1), Right.READ, NODE, ttl_s=-1, keys=KEYS),
            "other key": cap(key(2), Right.READ, NODE, keys=KEYS),
            "other node": cap(key(1), Right.READ, "transfer-other", keys=KEYS),
            "write only": cap(key(1), Right.WRITE, NODE, keys=KEYS),
            "tampered": body + bytes(16),
            "signed by another cluster": cap(key(1), Right.READ, NODE, keys=DEV_KEYS),
        }
        for why, token in refused.items():
            with pytest.raises(TransferError, match="forbidden"):
                await peer.read([key(1)], caps=[token])
            assert why  # (named for the failure message)
        assert [bytes(v) for v in await peer.read([key(1)], caps=[good])] == [data]

    async def test_writes_need_a_capability_for_that_key_offset_size_and_tier(
            self, node: BlockServer, peer: TcpTransport) -> None:
        data = os.urandom(BLOCK)
        placed = dict(tier=0, offset=BLOCK, size=BLOCK, keys=KEYS)
        refused = [
            ([], "no capability"),
            ([cap(key(1), Right.WRITE, NODE, **{**placed, "offset": 0})], "other offset"),
            ([cap(key(1), Right.WRITE, NODE, **{**placed, "size": BLOCK // 2})], "other size"),
            ([cap(key(1), Right.WRITE, NODE, **{**placed, "tier": 1})], "other tier"),
            ([cap(key(1), Right.READ, NODE, **placed)], "read only"),
            ([cap(key(1), Right.WRITE, NODE, ttl_s=-1, **placed)], "expired"),
        ]
        for tokens, why in refused:
            with pytest.raises(TransferError):
                await peer.write([key(1)], [data], caps=tokens, offsets=[BLOCK])
            assert not await node.store.dram.contains(key(1)), why
        assert node.store.dram.inventory() == [] and node.refused_requests == len(refused)
        await peer.write([key(1)], [data], caps=[cap(key(1), Right.WRITE, NODE, **placed)], offsets=[BLOCK])
        assert bytes(node.store.dram.view(key(1))) == data

    async def test_deletes_and_listing_need_their_rights(self, node: BlockServer, peer: TcpTransport) -> None:
        await store_one(node, key(1), os.urandom(BLOCK))
        with pytest.raises(TransferError, match="forbidden"):
            await peer.delete([key(1)], caps=[cap(key(1), Right.READ, NODE, keys=KEYS)])
        listing = await peer.request(Request(Op.INVENTORY, caps=[cap(b"", Right.READ, NODE, keys=KEYS)]))
        assert not listing.ok and not listing.keys
        assert not (await peer.request(Request(Op.INVENTORY))).ok
        listing = await peer.request(Request(Op.INVENTORY, caps=[cap(b"", Right.LIST, NODE, keys=KEYS)]))
        assert listing.ok and listing.keys == [key(1)]
        assert await peer.delete([key(1)], caps=[cap(key(1), Right.DELETE, NODE, keys=KEYS)]) == 1


class TestRememberedCapabilities:
    """The node remembers tokens whose signature it checked; that must never widen what they grant."""

    def test_a_remembered_token_still_expires_and_still_covers_only_its_key_and_right(self) -> None:
        checker = CapabilityChecker(NODE, KEYS.grant, KEYS.park)
        token = cap(key(1), Right.READ, node=NODE, keys=KEYS, ttl_s=60.0)
        checker.check(token, Right.READ, key(1))
        checker.check(token, Right.READ, key(1))  # remembered: no MAC this time, same answer
        with pytest.raises(CapabilityError, match="expired"):
            checker.check(token, Right.READ, key(1), now=time.time() + 120)
        with pytest.raises(CapabilityError, match="another key"):
            checker.check(token, Right.READ, key(2))
        with pytest.raises(CapabilityError, match="does not grant"):
            checker.check(token, Right.WRITE, key(1))

    def test_a_forgery_of_a_remembered_token_is_refused(self) -> None:
        checker = CapabilityChecker(NODE, KEYS.grant, KEYS.park)
        token = cap(key(1), node=NODE, keys=KEYS)
        checker.check(token, Right.READ, key(1))
        for forged in (token[:-1] + bytes([token[-1] ^ 1]), token.replace(key(1), key(2))):
            with pytest.raises(CapabilityError):
                checker.check(forged, Right.READ, None)

    def test_what_it_remembers_is_bounded(self) -> None:
        checker = CapabilityChecker(NODE, KEYS.grant, KEYS.park, remembered=2)
        tokens = [cap(key(i), node=NODE, keys=KEYS) for i in range(5)]
        for i, token in enumerate(tokens):
            checker.check(token, Right.READ, key(i))
        assert list(checker._verified) == tokens[-2:]  # the oldest are forgotten, never more than asked


class TestParkCapabilities:
    async def test_a_worker_can_park_only_its_own_hand_off_keys_on_nvme(self, node: BlockServer) -> None:
        peer = TcpTransport(node.address, keys=KEYS)
        data = os.urandom(BLOCK)
        park = sign_park(KEYS.park, NODE, "req-1", 0, ttl_s=60)
        await peer.write([handoff_key("req-1", 0)], [data], caps=[park], tier=Tier.NVME)
        assert [bytes(v) for v in await peer.read([handoff_key("req-1", 0)], caps=[park])] == [data]
        with pytest.raises(TransferError, match="forbidden"):  # a content key under a park capability
            await peer.write([key(1)], [data], caps=[park], tier=Tier.NVME)
        with pytest.raises(TransferError, match="forbidden"):  # into the pool's DRAM
            await peer.write([handoff_key("req-1", 0)], [data], caps=[park], tier=Tier.DRAM)
        forged = msgspec.msgpack.encode([*msgspec.msgpack.decode(park[:-16])[:2], key(1), time.time() + 60, 1, -1, -1,
                                         "req-1", 0])
        with pytest.raises(TransferError, match="forbidden"):  # claims another key for the request
            await peer.write([key(1)], [data], caps=[forged + park[-16:]], tier=Tier.NVME)
        await peer.close()
        assert not await node.store.tiers[Tier.NVME].contains(key(1))


class TestBounds:
    async def test_an_oversized_header_is_refused_before_it_is_allocated(self, node: BlockServer) -> None:
        host, port = node.address.split(":")
        tracemalloc.start()
        try:
            for authenticated in (False, True, True):
                ch = await Channel.connect(host, int(port))
                if authenticated:
                    await authenticate_to_node(ch, KEYS.handshake)
                await asyncio.get_running_loop().sock_sendall(ch.sock, LEN.pack(64 << 20))  # "64 MiB follow"
                with pytest.raises(ChannelClosed):  # the node hangs up
                    await asyncio.wait_for(ch.recv_header(), 10)
                ch.close()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20  # three 64 MiB claims, never allocated
        await store_one(node, key(1), os.urandom(BLOCK))  # the node serves others

    async def test_connections_over_the_limit_are_closed_and_others_still_served(self, node: BlockServer) -> None:
        host, port = node.address.split(":")
        held = [socket.create_connection((host, int(port))) for _ in range(node.max_connections)]
        deadline = time.monotonic() + 10
        while len(node._channels) < node.max_connections:
            assert time.monotonic() < deadline
            await asyncio.sleep(0)
        extra = socket.create_connection((host, int(port)))
        extra.settimeout(10)
        assert await asyncio.to_thread(extra.recv, 1) == b""  # closed at once, nothing read
        assert node.refused_connections >= 1
        extra.close()
        for s in held:
            s.close()
        while node._channels:  # the node notices the hang-ups
            assert time.monotonic() < deadline
            await asyncio.sleep(0)
        await store_one(node, key(2), os.urandom(BLOCK))

    async def test_idle_connections_are_closed(self) -> None:
        store = NodeStore(ShmTier(1 << 20))
        server = BlockServer(store, node_id=NODE, keys=KEYS, idle_timeout_s=0.2)
        await server.start()
        peer = TcpTransport(server.address, keys=KEYS)
        assert (await peer.request(Request(Op.HELLO))).ok
        deadline = time.monotonic() + 10
        while server._channels:  # closed by the node, not by us
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await peer.close()
        await server.stop()
        await store.close()


class TestSharedMemorySegment:
    async def test_the_segment_is_private_and_named_only_after_the_handshake(self, node: BlockServer) -> None:
        mode = os.stat(f"/dev/shm/{node.store.dram.segment.lstrip('/')}").st_mode & 0o777
        assert mode == 0o600
        peer = TcpTransport(node.address, keys=KEYS)
        assert (await peer.request(Request(Op.HELLO))).segment == node.store.dram.segment
        await peer.close()
        stranger = TcpTransport(node.address, keys=DEV_KEYS)
        with pytest.raises(TransferError, match="AuthError"):
            await stranger.request(Request(Op.HELLO))
        await stranger.close()
