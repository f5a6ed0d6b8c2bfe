"""The pool end to end on one node: index placements, bytes over the data plane, demotion to
NVMe and a real S3 server, promotion back on a hit, and S3 outages."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from halfmoon.core.keys import BlockHasher
from halfmoon.kv.pool_index import PoolIndex
from halfmoon.kv.pool_types import NodeSpec, OrderKind, PoolConfig, Tier
from halfmoon.policy.eviction import Watermarks
from halfmoon.storage.dram import ShmTier
from halfmoon.storage.node import NodeStore
from halfmoon.storage.nvme import DirTier
from halfmoon.storage.s3 import S3Config, S3Tier
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.orders import execute
from halfmoon.transfer.server import BlockServer
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import TransferError
from tests.fixtures.dataplane import Granted, cap
from tests.fixtures.s3 import free_ports, s3_config, s3_server  # noqa: F401  (fixtures)

BLOCK = 64 << 10
KEYS = BlockHasher(16, "roundtrip-model").keys(list(range(16 * 32)))


class Pool:
    """One transfer node, its index entry and a client: what the services will wire together."""

    def __init__(self, store: NodeStore, server: BlockServer, index: PoolIndex, client: TransferClient) -> None:
        self.store, self.server, self.index, self.client = store, server, index, client
        self.payloads: dict[bytes, bytes] = {}

    async def put(self, keys: list[bytes], now: float) -> None:
        placements = self.index.put_start(keys, [BLOCK] * len(keys), now)
        transport = Granted(await self.client.transport(self.server.address))
        for p in placements:
            self.payloads[p.key] = os.urandom(BLOCK)
            (replica,) = p.replicas
            await transport.write([p.key], [self.payloads[p.key]], offsets=[replica.offset], tier=replica.tier)
        self.index.put_end(keys, now)

    async def get(self, keys: list[bytes], now: float) -> list[bytes]:
        result = self.index.lookup(keys, now)
        transport = Granted(await self.client.transport(self.server.address))
        views = await transport.read(keys[: len(result.hits)])
        self.index.release(result.lease.lease_id)
        return [bytes(v) for v in views]

    async def run_orders(self, now: float) -> list:  # type: ignore[type-arg]
        orders = self.index.plan(now)
        for order in orders:
            ok = await execute(order, self.store, self.client, lambda n: self.server.address, cap(order.key))
            if order.kind is not OrderKind.FREE:
                self.index.order_done(order.order_id, ok, now)
        return orders


@pytest.fixture
async def pool(tmp_path, s3_config: S3Config) -> AsyncIterator[Pool]:
    s3 = S3Tier(s3_config)
    await s3.ensure_bucket()
    store = NodeStore(ShmTier(10 * BLOCK), DirTier(tmp_path / "nvme", 3 * BLOCK), s3)
    server = BlockServer(store)
    await server.start()
    index = PoolIndex(PoolConfig(watermarks=Watermarks(high=0.8, low=0.5)))
    capacity = {Tier.DRAM: 10 * BLOCK, Tier.NVME: 3 * BLOCK, Tier.S3: 1 << 30}
    index.add_node(NodeSpec("node-a", server.address, store.dram.segment, capacity))
    client = TransferClient()
    yield Pool(store, server, index, client)
    await client.close()
    await server.stop()
    await store.close()


class TestTiersEndToEnd:
    async def test_demote_to_nvme_and_s3_then_promote_on_hit(self, pool: Pool) -> None:
        keys = KEYS[:9]
        await pool.put(keys, now=0)
        assert await pool.get(keys, now=1) == [pool.payloads[k] for k in keys]
        orders = await pool.run_orders(now=2)
        assert [o.dst.tier for o in orders] == [Tier.NVME, Tier.NVME, Tier.NVME, Tier.S3]
        assert await pool.store.tiers[Tier.S3].contains(orders[-1].key)
        assert not await pool.store.dram.contains(orders[-1].key)
        assert await pool.get(keys, now=3) == [pool.payloads[k] for k in keys]  # served from every tier
        pool.index.remove(keys[4:8])  # make DRAM room below the low watermark
        for key in keys[4:8]:
            await pool.store.delete(key)
        s3_key = orders[-1].key
        promoted = await pool.run_orders(now=4)  # the hit at now=3 asked for promotions
        assert s3_key in {o.key for o in promoted if o.kind is OrderKind.PROMOTE}
        assert await pool.store.dram.contains(s3_key)
        hit = pool.index.lookup([s3_key], now=5).hits[0]
        assert [r.tier for r in hit] == [Tier.DRAM, Tier.S3]
        assert bytes(pool.store.dram.view(s3_key)) == pool.payloads[s3_key]


class TestS3Outage:
    async def test_unreachable_s3_keeps_dram_and_nvme_serving(self, tmp_path) -> None:
        (port,) = free_ports(1)
        config = S3Config(endpoint_url=f"http://127.0.0.1:{port}", bucket="b", connect_timeout_s=0.3, max_attempts=1)
        dead = S3Tier(config)
        store = NodeStore(ShmTier(1 << 20), DirTier(tmp_path, 1 << 20), dead)
        await store.write(KEYS[0], b"in dram")
        await store.write(KEYS[1], b"on nvme", Tier.NVME)
        assert bytes(await store.read(KEYS[0])) == b"in dram"
        assert bytes(await store.read(KEYS[1])) == b"on nvme"
        assert store.unavailable == set()
        with pytest.raises(Exception, match="not found"):
            await store.read(KEYS[2])  # looked in S3 too, which failed: a miss, not a crash
        assert store.unavailable == {Tier.S3}
        inventory = await store.inventory()
        assert {(b.key, b.tier) for b in inventory} == {(KEYS[0], Tier.DRAM), (KEYS[1], Tier.NVME)}
        await store.close()


class TestTwoNodes:
    async def test_hot_block_replicates_and_a_dead_node_only_loses_cache(self) -> None:
        stores = [NodeStore(ShmTier(10 * BLOCK)) for _ in range(2)]
        servers = [BlockServer(s) for s in stores]
        for srv in servers:
            await srv.start()
        index = PoolIndex(PoolConfig(hot_reads_per_s=50, hot_window_s=1.0, max_hot_replicas=2))
        for name, store, srv in zip("ab", stores, servers):
            index.add_node(NodeSpec(name, srv.address, store.dram.segment, {Tier.DRAM: 10 * BLOCK}))
        address = {name: srv.address for name, srv in zip("ab", servers)}
        client = TransferClient()
        payload = os.urandom(BLOCK)
        (placement,) = index.put_start(KEYS[:1], [BLOCK], now=0)
        (replica,) = placement.replicas
        transport = Granted(await client.transport(address[replica.node]))
        await transport.write(KEYS[:1], [payload], offsets=[replica.offset])
        index.put_end(KEYS[:1], now=0)
        for i in range(100):  # 100 reads per second
            index.release(index.lookup(KEYS[:1], now=1 + i / 100).lease.lease_id)
        (order,) = index.plan(now=2)
        assert order.kind is OrderKind.REPLICATE and order.dst.node != replica.node
        target = stores["ab".index(order.dst.node)]
        assert await execute(order, target, client, address.__getitem__, cap(KEYS[0]))
        index.order_done(order.order_id, True, now=2)
        assert bytes(target.dram.view(KEYS[0])) == payload
        assert {r.node for r in index.lookup(KEYS[:1], now=3).hits[0]} == {"a", "b"}

        dead = "ab".index(replica.node)  # the original holder goes away
        await servers[dead].stop()
        with pytest.raises(TransferError):
            await Granted(TcpTransport(address[replica.node])).read(KEYS[:1])
        assert index.remove_node(replica.node, now=4) == []
        (hit,) = index.lookup(KEYS[:1], now=4).hits
        assert [r.node for r in hit] == [order.dst.node]
        survivor = Granted(await client.transport(address[order.dst.node]))
        assert [bytes(v) for v in await survivor.read(KEYS[:1])] == [payload]
        await client.close()
        await servers[1 - dead].stop()
        for store in stores:
            await store.close()
