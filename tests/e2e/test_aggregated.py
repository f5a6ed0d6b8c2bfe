"""Aggregated mode (``halfmoon up --aggregated 1``): one instance prefills and decodes each request itself,
placed by the conductor, reusing and filling the KVCache pool; its greedy output is the reference model's,
which is what the disaggregated deployment serves too (tests/e2e/test_serving.py)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol import codecs
from halfmoon.protocol.pool import StatsRequest
from halfmoon.protocol.subjects import Subjects
from halfmoon.runtime import request
from tests.e2e.conftest import AUTH, REFERENCE_DTYPE, admin_nats, model_name, reference_text, start_cluster
from tests.e2e.test_conductor import SubmitWatch
from tests.e2e.test_serving import MAX_TOKENS, complete_all, prompts


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Without its local prefix cache, a prefix the instance reuses can only have come back from the pool.
    cluster = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("run-aggregated"),
                            env={"HALFMOON_LOCAL_PREFIX_CACHE": "false"}, dtype=REFERENCE_DTYPE, prefill=0, decode=0,
                            aggregated=1)
    yield cluster
    cluster.stop()


class TestAggregatedGreedy:
    async def test_completions_equal_the_reference_and_run_on_the_aggregated_instance(
            self, cluster: LocalCluster, tiny_model_dir: Path) -> None:
        batch = prompts(tiny_model_dir)
        async with SubmitWatch(cluster) as submits:
            texts = await complete_all(cluster, batch)
        assert texts == [reference_text(tiny_model_dir, p, MAX_TOKENS) for p in batch]
        assert set(submits.where.values()) == {"aggregated-0"}


class TestAggregatedPrefixReuse:
    async def test_a_repeated_prefix_comes_back_from_the_pool(self, cluster: LocalCluster) -> None:
        rng = random.Random(5)
        prefix = [rng.randrange(3, 2000) for _ in range(80)]
        name = model_name(cluster)
        nc = await admin_nats(cluster)

        async def pool_blocks() -> int:
            return (await request(nc, Subjects("e2e").cache("stats"), StatsRequest(), codecs.CACHE_STATS, 10)).blocks

        try:
            async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=120) as client:
                usages, before = [], await pool_blocks()
                for tail in ([7, 8, 9], [10, 11, 12, 13]):
                    reply = await client.post("/v1/completions", json={"model": name, "prompt": prefix + tail,
                                                                       "max_tokens": 4, "temperature": 0})
                    assert reply.status_code == 200, reply.text
                    usages.append(reply.json()["usage"])
                    # the prompt's blocks are stored while the answer streams, and may land after it ends
                    deadline = asyncio.get_running_loop().time() + 20
                    while await pool_blocks() < before + 80 // 16:
                        assert asyncio.get_running_loop().time() < deadline, "the prompt's full blocks were not stored"
                        await asyncio.sleep(0.1)
        finally:
            await nc.close()
        assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
        assert usages[1]["prompt_tokens_details"]["cached_tokens"] == 80 // 16 * 16
