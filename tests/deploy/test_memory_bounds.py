"""A started deployment reports a memory bound for every process, and after requests each process's RSS is
inside it, as `halfmoon up` checks while it runs."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from halfmoon.cli.up import over_bound
from halfmoon.deploy.local import LocalCluster
from halfmoon.deploy.memory import MIB, process_memory

SEGMENT = 32 * MIB  # small, so the requests below write a good share of it
ENV = {"HALFMOON_DRAM_BYTES": str(SEGMENT), "HALFMOON_KV_CACHE_BYTES": str(64 * MIB)}
REQUESTS, CLIENTS = 48, 4


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tiny_model_dir, tmp_path_factory.mktemp("run-memory"), {"prefill": 1, "decode": 1},
                           gateway_port=0, namespace="memory", env=ENV)
    cluster.start(timeout=300)
    yield cluster
    cluster.stop()


async def short_requests(url: str, model: str, vocab: int) -> list[int]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(96)] for _ in range(REQUESTS)]  # fresh: all to the pool
    statuses: list[int] = []

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            while prompts:
                reply = await http.post("/v1/completions", json={"model": model, "prompt": prompts.pop(),
                                                                 "max_tokens": 8, "temperature": 0})
                statuses.append(reply.status_code)

    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return statuses


def test_every_process_reports_a_bound_and_stays_inside_it(cluster: LocalCluster, tiny_model_dir: Path) -> None:
    from transformers import AutoConfig

    bounds = cluster.memory_bounds()
    assert set(bounds) == {iid for _, iid in cluster.plan}
    for engine in ("prefill-0", "decode-0"):
        assert bounds[engine].parts["transfer segments"] == SEGMENT
        assert 64 * MIB - 64 * 1024 < bounds[engine].parts["KV cache"] <= 64 * MIB
    assert bounds["transfer-0"].parts["DRAM segment"] == SEGMENT
    assert bounds["cache-manager-0"].parts["pool index"] > 0

    model = httpx.get(f"{cluster.url}/v1/models", timeout=10).json()["data"][0]["id"]
    statuses = asyncio.run(short_requests(cluster.url, model, AutoConfig.from_pretrained(tiny_model_dir).vocab_size))
    assert statuses == [200] * REQUESTS

    pids = cluster.pids()
    memory = {iid: process_memory(pids[iid]) for iid in bounds}
    # the blocks prefill wrote to the pool went through the segment it maps: its RSS counts them
    assert memory["prefill-0"] is not None and memory["prefill-0"].shmem > 0
    for iid, bound in bounds.items():
        held = memory[iid]
        assert held is not None, f"{iid} exited"
        assert held.rss <= bound.total, f"{iid}: RSS {held.rss / MIB:.0f} MiB over its bound {bound.describe()}"
    assert over_bound(cluster, set()) == []
