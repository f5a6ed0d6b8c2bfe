"""The cache-manager and a transfer node as services on a real NATS, under a cluster secret: the
capabilities in put_start / lookup answers are what lets a writer and a reader through, tenant
quotas refuse puts, a node runs only the orders the cache-manager signed, and a reader never uses a
block rewritten without the KV MAC key."""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import torch

from halfmoon.core.block_format import BlockLayout, encode_block
from halfmoon.core.tiers import Tier
from halfmoon.kv.pool_types import Order, OrderKind, Replica
from halfmoon.kv.pool_wire import order_to_wire
from halfmoon.protocol import codecs
from halfmoon.protocol.cache import Lookup, PutEnd, PutStart
from halfmoon.protocol.pool import OrderBatch
from halfmoon.runtime import ServiceHost, request
from halfmoon.runtime.pool_client import PoolClient
from halfmoon.services.cache_manager.service import CacheManagerConfig, CacheManagerService
from halfmoon.services.transfer.service import TransferConfig, TransferService
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import TransferError

SECRET = "pool-security-tests-secret-0123456789"
BLOCK = 4096


def key(i: int) -> bytes:
    return hashlib.sha256(f"pool-sec-{i}".encode()).digest()


class Pool:
    def __init__(self, nc, namespace: str, cm: CacheManagerService,  # type: ignore[no-untyped-def]
                 node: TransferService) -> None:
        self.nc, self.namespace, self.cm, self.node = nc, namespace, cm, node
        self.peer = TcpTransport(node.address, keys=cm.cluster_keys)

    async def ask(self, operation: str, message, codec):  # type: ignore[no-untyped-def]
        return await request(self.nc, f"{self.namespace}.v1.cache.{operation}", message, codec, 5)

    async def put(self, keys: list[bytes], tenant: str) -> list[bytes]:
        """put_start, write with the granted capabilities, put_end; the keys that were placed."""
        plan = await self.ask("put_start", PutStart(writer="w", keys=tuple(keys), sizes=(BLOCK,) * len(keys),
                                                   tenant=tenant), codecs.CACHE_PUT_PLAN)
        for p in plan.placements:
            await self.peer.write([p.key], [os.urandom(BLOCK)], caps=[p.capability], offsets=[p.offset])
        placed = [p.key for p in plan.placements]
        if placed:
            await self.ask("put_end", PutEnd(writer="w", keys=tuple(placed)), codecs.CACHE_ACK)
        return placed


@pytest.fixture
async def pool(nc, nats_server, namespace: str, tmp_path) -> AsyncIterator[Pool]:  # type: ignore[no-untyped-def]
    common = dict(nats_url=nats_server.url, namespace=namespace, heartbeat_interval_s=0.1, cluster_secret=SECRET)
    cm = CacheManagerService(CacheManagerConfig(**common, tenant_quota_bytes=2 * BLOCK, lease_ttl_s=30))
    node = TransferService(TransferConfig(**common, dram_bytes=1 << 20, nvme_dir=str(tmp_path / "nvme")))
    async with ServiceHost(cm), ServiceHost(node):
        deadline = time.monotonic() + 20
        while node.instance_id not in cm.nodes:  # it joins on its first heartbeat (INVENTORY with LIST)
            assert time.monotonic() < deadline, "the transfer node never joined"
            await asyncio.sleep(0.05)
        pool = Pool(nc, namespace, cm, node)
        yield pool
        await pool.peer.close()


class TestGrantedCapabilities:
    async def test_put_start_lets_the_writer_in_and_lookup_the_reader(self, pool: Pool) -> None:
        assert await pool.put([key(1)], tenant="") == [key(1)]
        found = await pool.ask("lookup", Lookup(keys=(key(1),)), codecs.CACHE_LOOKUP_RESULT)
        (replica,) = found.hits[0].replicas
        assert len(await pool.peer.read([key(1)], caps=[replica.capability])) == 1
        with pytest.raises(TransferError, match="forbidden"):  # a read capability does not write
            await pool.peer.write([key(1)], [os.urandom(BLOCK)], caps=[replica.capability], offsets=[replica.offset])
        with pytest.raises(TransferError, match="forbidden"):  # nor reach another key
            await pool.peer.read([key(2)], caps=[replica.capability])
        again = await pool.ask("lookup", Lookup(keys=(key(1),)), codecs.CACHE_LOOKUP_RESULT)
        assert again.hits[0].replicas[0].capability == replica.capability  # reused while fresh, not re-signed


class TestTenantQuotas:
    async def test_a_tenant_over_quota_caches_nothing_while_another_still_caches(self, pool: Pool) -> None:
        assert await pool.put([key(1), key(2)], tenant="a") == [key(1), key(2)]
        assert await pool.put([key(3)], tenant="a") == []  # over quota: not placed, not cached
        found = await pool.ask("lookup", Lookup(keys=(key(3),)), codecs.CACHE_LOOKUP_RESULT)
        assert found.hits == () and not await pool.node.store.dram.contains(key(3))  # type: ignore[union-attr]
        assert await pool.put([key(4), key(5)], tenant="b") == [key(4), key(5)]


class TestSignedOrders:
    async def test_a_node_runs_only_orders_the_cache_manager_signed(self, pool: Pool) -> None:
        assert await pool.put([key(1)], tenant="") == [key(1)]
        store = pool.node.store
        assert store is not None
        extent = store.dram.locate(key(1))
        src = Replica(pool.node.instance_id, Tier.DRAM, extent.offset, BLOCK)
        demote = Order(1, OrderKind.DEMOTE, key(1), src, Replica(pool.node.instance_id, Tier.NVME, -1, BLOCK))
        subject = pool.node.subjects.transfer_orders(pool.node.instance_id)
        unsigned = OrderBatch(orders=(order_to_wire(demote),))
        reply = await request(pool.nc, subject, unsigned, codecs.ORDER_RESULTS, 5)
        assert reply.ok == (False,) and await store.dram.contains(key(1))
        free = Order(2, OrderKind.FREE, key(1), src, None)  # signed, but for another target
        borrowed = msgspec.structs.replace(order_to_wire(demote), capability=pool.cm.grants.order(free).capability)
        reply = await request(pool.nc, subject, OrderBatch(orders=(borrowed,)), codecs.ORDER_RESULTS, 5)
        assert reply.ok == (False,) and await store.dram.contains(key(1))
        signed = OrderBatch(orders=(pool.cm.grants.order(demote),))
        assert (await request(pool.nc, subject, signed, codecs.ORDER_RESULTS, 5)).ok == (True,)
        assert await store.tiers[Tier.NVME].contains(key(1)) and not await store.dram.contains(key(1))


class TestTamperedBlocksAreNeverServed:
    async def test_a_forged_block_in_dram_or_on_nvme_ends_the_served_prefix(self, pool: Pool) -> None:
        layout = BlockLayout(hashlib.sha256(b"m").digest(), torch.float16, 4, 16, 100, pool.cm.cluster_keys.kv_mac)
        blocks = [encode_block(layout, torch.randn(4, 2, 16, 16, 100)) for _ in range(3)]  # ~400 KB each
        clean = PoolClient(pool.cm, TransferClient(keys=pool.cm.cluster_keys), layout)
        chain = [key(10), key(11), key(12)]
        stored = await clean.store(chain, blocks, first_position=0)
        assert [stored[k].tier for k in chain] == [0, 0, 1]  # the 1 MiB segment holds two: the third on NVMe
        fetched = await clean.fetch_prefix(chain)
        assert [bytes(p) for p in fetched.payloads] == [bytes(b) for b in blocks]
        await clean.release(fetched.lease_id)

        forger = layout.keyed(bytes(32))  # well-formed blocks, sealed without the cluster's key
        store = pool.node.store
        assert store is not None
        nvme_file = store.tiers[Tier.NVME]._path(key(12))  # type: ignore[attr-defined]
        nvme_file.write_bytes(encode_block(forger, torch.zeros(4, 2, 16, 16, 100), key(12)))
        fetched = await clean.fetch_prefix(chain)
        assert [bytes(p) for p in fetched.payloads] == [bytes(b) for b in blocks[:2]]  # the rest is recomputed
        await clean.release(fetched.lease_id)

        offset = store.dram.locate(key(10)).offset
        fd = os.open(f"/dev/shm/{store.dram.segment.lstrip('/')}", os.O_RDWR)
        with mmap.mmap(fd, 0) as shm:
            forged = encode_block(forger, torch.zeros(4, 2, 16, 16, 100), key(10))
            shm[offset : offset + len(forged)] = forged
        os.close(fd)
        assert (await clean.fetch_prefix(chain)).payloads == []
        await clean.transfer.close()
