"""The KVCache pool on the live system: prefix reuse, tenant isolation, corruption, and the loss
of the cache-manager or a transfer node."""

from __future__ import annotations

import asyncio
import mmap
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest

from halfmoon.core.block_format import FIXED
from halfmoon.core.cluster_keys import ClusterKeys
from halfmoon.deploy.local import LocalCluster
from halfmoon.deploy.topology import SERVICES
from halfmoon.protocol import codecs
from halfmoon.protocol.pool import StatsRequest
from halfmoon.protocol.subjects import Subjects
from halfmoon.transfer.framing import Op, Request
from halfmoon.transfer.tcp import TcpTransport
from tests.e2e.conftest import AUTH, REFERENCE_DTYPE, admin_nats, model_name, reference_text, start_cluster
from tests.fixtures.dataplane import cap

BLOCK = 16
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Without the engine's local prefix cache every reuse below comes from the pool itself.
    cluster = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("run-pool"),
                            env={"HALFMOON_LOCAL_PREFIX_CACHE": "false"}, dtype=REFERENCE_DTYPE, prefill=1, decode=1,
                            transfer=2)
    yield cluster
    cluster.stop()


def tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(count)]


def complete(cluster: LocalCluster, prompt: list[int], salt: str | None = None) -> dict:
    body = {"model": model_name(cluster), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    reply = httpx.post(f"{cluster.url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


async def pool_stats(cluster: LocalCluster):  # type: ignore[no-untyped-def]
    nc = await admin_nats(cluster)
    try:
        msg = await nc.request(Subjects("e2e").cache("stats"), codecs.CACHE_STATS_REQUEST.encode(StatsRequest()),
                               timeout=5)
        return codecs.CACHE_STATS.decode(msg.data)
    finally:
        await nc.close()


def wait_for_blocks(cluster: LocalCluster, at_least: int, deadline_s: float = 30.0) -> int:
    """Poll the cache-manager's stats until it indexes ``at_least`` blocks (it may be restarting)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            blocks = asyncio.run(pool_stats(cluster)).blocks
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            blocks = -1
        if blocks >= at_least:
            return blocks
        time.sleep(0.1)
    raise AssertionError(f"cache-manager does not index {at_least} blocks after {deadline_s}s")


class TestPrefixReuse:
    def test_second_request_computes_only_the_unshared_tokens(self, cluster: LocalCluster,
                                                              tiny_model_dir: Path) -> None:
        prefix = tokens(300, seed=1)
        first, second = prefix + tokens(20, seed=2), prefix + tokens(37, seed=3)
        assert cached(complete(cluster, first)) == 0
        warm = complete(cluster, second)
        shared_blocks = 300 // BLOCK
        assert cached(warm) == shared_blocks * BLOCK
        assert warm["usage"]["prompt_tokens"] - cached(warm) == len(second) - shared_blocks * BLOCK
        cold = complete(cluster, second, salt="cold-baseline")
        assert cached(cold) == 0
        expected = reference_text(tiny_model_dir, second, MAX_TOKENS)
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"] == expected


class TestTenantSalts:
    def test_salts_isolate_tenants(self, cluster: LocalCluster) -> None:
        prompt = tokens(130, seed=4)
        assert cached(complete(cluster, prompt, salt="tenant-a")) == 0
        assert cached(complete(cluster, prompt, salt="tenant-b")) == 0
        assert cached(complete(cluster, prompt, salt="tenant-a")) == 128
        assert cached(complete(cluster, prompt)) == 0


def corrupt_every_dram_block(cluster: LocalCluster, node: str, address: str) -> int:
    """Rewrite every block a transfer node holds in its shared-memory segment as someone who can map
    it but lacks the KV MAC key would: flip a byte of each layer and fix up the tags with another key
    (what recomputing the old CRC-32 amounted to). Locating them takes the cluster's secret."""
    keys = ClusterKeys.from_secret(cluster.cluster_secret.encode())

    async def locate() -> tuple[str, list[tuple[int, int]]]:
        transport = TcpTransport(address, pool_size=1, keys=keys)
        try:
            hello = await transport.request(Request(Op.HELLO))
            inventory = await transport.request(Request(Op.INVENTORY, caps=[cap(b"", node=node, keys=keys)]))
        finally:
            await transport.close()
        blocks = [(o, s) for t, o, s in zip(inventory.tiers, inventory.offsets, inventory.sizes) if t == 0]
        return hello.segment, blocks

    segment, blocks = asyncio.run(locate())
    fd = os.open(f"/dev/shm/{segment.lstrip('/')}", os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as shm:
            for offset, size in blocks:
                shm[offset + size - 7] ^= 0xFF
                shm[offset + FIXED.size : offset + FIXED.size + 16] = os.urandom(16)  # a forged tag
    finally:
        os.close(fd)
    return len(blocks)


async def transfer_addresses(cluster: LocalCluster) -> dict[str, str]:
    nc = await admin_nats(cluster)
    found: dict[str, str] = {}
    done = asyncio.Event()

    async def on_beat(msg) -> None:  # type: ignore[no-untyped-def]
        beat = codecs.HEARTBEAT.decode(msg.data)
        if beat.role.value == "transfer":
            found[beat.instance_id] = beat.address
            if len(found) == 2:
                done.set()

    await nc.subscribe(Subjects("e2e").heartbeat, cb=on_beat)
    try:
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await nc.close()
    return found


class TestCorruptBlocks:
    def test_flipped_bytes_are_recomputed_never_served(self, cluster: LocalCluster, tiny_model_dir: Path) -> None:
        prompt = tokens(200, seed=5)
        complete(cluster, prompt)
        nodes = asyncio.run(transfer_addresses(cluster))
        flipped = sum(corrupt_every_dram_block(cluster, node, a) for node, a in nodes.items())
        assert flipped >= 200 // BLOCK
        again = complete(cluster, prompt)
        assert cached(again) == 0
        assert again["choices"][0]["text"] == reference_text(tiny_model_dir, prompt, MAX_TOKENS)


class TestLosingPoolServices:
    def test_restarted_cache_manager_serves_earlier_blocks(self, cluster: LocalCluster) -> None:
        prompt = tokens(160, seed=6)
        complete(cluster, prompt)
        before = wait_for_blocks(cluster, 160 // BLOCK)
        cluster.kill("cache-manager-0")
        spec = next(s for s in SERVICES if s.name == "cache-manager")
        cluster.start_instance(spec, "cache-manager-0")
        assert wait_for_blocks(cluster, before) >= before
        assert cached(complete(cluster, prompt)) == (160 - 1) // BLOCK * BLOCK

    def test_killed_transfer_node_only_costs_recompute(self, cluster: LocalCluster, tiny_model_dir: Path) -> None:
        prompts = [tokens(96, seed=10 + i) for i in range(4)]
        for prompt in prompts:
            complete(cluster, prompt)
        cluster.kill("transfer-0")
        for prompt in prompts:
            reply = complete(cluster, prompt)
            assert reply["choices"][0]["text"] == reference_text(tiny_model_dir, prompt, MAX_TOKENS)
