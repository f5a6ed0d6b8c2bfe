"""Two cache-managers on a real NATS (JetStream): one is active, the other a hot standby that serves
nothing; when the active one is gone, the standby takes the lease over and serves the pool, its index
rebuilt from the transfer node's inventory (the block stored through the first is found through the
second)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import pytest

from halfmoon.protocol import codecs
from halfmoon.protocol.cache import Lookup, PutEnd, PutStart
from halfmoon.runtime import ServiceHost, request
from halfmoon.runtime.leadership import Leadership
from halfmoon.services.cache_manager.service import CacheManagerConfig, CacheManagerService
from halfmoon.services.transfer.service import TransferConfig, TransferService
from halfmoon.transfer.tcp import TcpTransport

BLOCK = 4096
SECRET = "standby-tests-cluster-secret-0123456789"


async def until(condition, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"{what} not within {timeout}s"
        await asyncio.sleep(0.05)


@pytest.fixture
def common(nats_server, namespace: str) -> dict:  # type: ignore[no-untyped-def]
    return dict(nats_url=nats_server.url, namespace=namespace, heartbeat_interval_s=0.1, cluster_secret=SECRET)


class TestLeadership:
    async def test_one_holder_at_a_time_and_the_next_after_the_lease_lapses(self, nc, namespace: str) -> None:
        js, bucket = nc.jetstream(), f"leaders_{namespace}"
        first, second = (Leadership(js, bucket, "role", holder, ttl_s=0.9) for holder in ("a", "b"))
        assert await first.try_acquire() and first.held
        assert not await second.try_acquire() and not second.held
        assert await first.renew()
        await until(lambda: not first.held, "the unrenewed lease seen as lost by its holder", 5)
        end = time.monotonic() + 10
        while not await second.try_acquire():  # the bucket's entry expires a full ttl after its last write
            assert time.monotonic() < end, "the lapsed lease was never free"
            await asyncio.sleep(0.1)
        assert second.held and not await first.renew()  # the old holder cannot renew its way back

    async def test_a_holder_restarted_under_its_id_takes_its_lease_back_at_once(self, nc, namespace: str) -> None:
        js, bucket = nc.jetstream(), f"leaders_{namespace}"
        assert await Leadership(js, bucket, "role", "cache-manager-0", ttl_s=30).try_acquire()
        assert not await Leadership(js, bucket, "role", "cache-manager-1", ttl_s=30).try_acquire()
        restarted = Leadership(js, bucket, "role", "cache-manager-0", ttl_s=30)
        assert await restarted.try_acquire() and await restarted.renew()

    async def test_a_clean_release_frees_the_lease_at_once(self, nc, namespace: str) -> None:
        js, bucket = nc.jetstream(), f"leaders_{namespace}"
        first, second = (Leadership(js, bucket, "role", holder, ttl_s=30) for holder in ("a", "b"))
        assert await first.try_acquire()
        await first.release()
        assert not first.held and await second.try_acquire()


class TestStandbyTakesOver:
    async def test_the_standby_serves_nothing_then_everything_with_the_blocks(  # type: ignore[no-untyped-def]
        self, nc, common: dict, namespace: str, tmp_path
    ) -> None:
        subject = f"{namespace}.v1.cache"
        key = hashlib.sha256(b"standby block").digest()
        node = TransferService(TransferConfig(**common, dram_bytes=1 << 20, nvme_dir=str(tmp_path / "nvme")))
        first = CacheManagerService(CacheManagerConfig(**common, instance_id="cache-manager-a", leadership_ttl_s=1.5))
        second = CacheManagerService(CacheManagerConfig(**common, instance_id="cache-manager-b", leadership_ttl_s=1.5))
        async with ServiceHost(node):
            first_host = await ServiceHost(first).__aenter__()
            try:
                assert first.active, "alone, it takes the lease at start"
                async with ServiceHost(second):
                    assert not second.active, "a second one waits as a standby"
                    await until(lambda: node.instance_id in first.nodes and node.instance_id in second.nodes,
                                "the node joining both")
                    plan = await request(nc, f"{subject}.put_start",
                                         PutStart(writer="w", keys=(key,), sizes=(BLOCK,)), codecs.CACHE_PUT_PLAN, 5)
                    (placed,) = plan.placements
                    peer = TcpTransport(node.address, keys=first.cluster_keys)
                    await peer.write([key], [os.urandom(BLOCK)], caps=[placed.capability], offsets=[placed.offset])
                    await peer.close()
                    await request(nc, f"{subject}.put_end", PutEnd(writer="w", keys=(key,)), codecs.CACHE_ACK, 5)
                    assert key not in {k for k, *_ in second.index.locate([key])}, "the standby did not serve the put"
                    await first_host.__aexit__(None, None, None)  # the active one stops
                    first_host = None
                    await until(lambda: second.active, "the standby taking over", 10)
                    await until(lambda: node.instance_id in second.nodes, "the node joining the new active manager")
                    found = await request(nc, f"{subject}.lookup", Lookup(keys=(key,)), codecs.CACHE_LOOKUP_RESULT, 5)
                    assert [hit.key for hit in found.hits] == [key], "the block stored through the first is found"
            finally:
                if first_host is not None:
                    await first_host.__aexit__(None, None, None)

    async def test_a_killed_active_one_is_replaced_once_its_lease_lapses(  # type: ignore[no-untyped-def]
        self, common: dict
    ) -> None:
        first = CacheManagerService(CacheManagerConfig(**common, instance_id="cache-manager-a", leadership_ttl_s=1.5))
        second = CacheManagerService(CacheManagerConfig(**common, instance_id="cache-manager-b", leadership_ttl_s=1.5))
        async with ServiceHost(first):
            assert first.active
            assert first._leading is not None  # the renewals stop as in a process killed outright
            first._leading.cancel()
            async with ServiceHost(second):
                await until(lambda: second.active, "the standby taking over a lease nobody renews", 10)
