"""The KV pool after faults, on a cluster as ``halfmoon up`` starts it: a transfer node that restarts (new
run, new port, empty segment) is joined again, and a block damaged in the node's shared-memory segment
leaves the pool and is written again, so prefix reuse comes back in both cases."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from halfmoon.deploy.drills import heartbeats, restart, wait_live
from halfmoon.deploy.local import LocalCluster
from tests.e2e.conftest import AUTH, REFERENCE_DTYPE, model_name, reference_text, start_cluster
from tests.e2e.test_pool import BLOCK, MAX_TOKENS, cached, complete, corrupt_every_dram_block, tokens

PROMPT_TOKENS = 320
REUSED = (PROMPT_TOKENS - 1) // BLOCK * BLOCK  # the last token is always computed
REUSE_BACK_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Without the engine's local prefix cache every reuse below comes from the pool itself.
    cluster = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("run-pool-faults"),
                            env={"HALFMOON_LOCAL_PREFIX_CACHE": "false"}, dtype=REFERENCE_DTYPE, prefill=1, decode=1)
    yield cluster
    cluster.stop()


def reuse_comes_back(cluster: LocalCluster, prompt: list[int], since: float) -> float:
    """Send ``prompt`` until it is reused (the first of these writes it to the pool); the seconds since ``since``."""
    while True:
        if cached(complete(cluster, prompt)) == REUSED:
            return time.monotonic() - since
        assert time.monotonic() - since < REUSE_BACK_WITHIN_S, \
            f"prefix reuse not back {REUSE_BACK_WITHIN_S} s after the fault"


def first_served(cluster: LocalCluster, prompt: list[int], timeout: float = 120.0) -> dict:
    """The first answer to ``prompt`` once the cluster schedules again (after a conductor restart)."""
    body = {"model": model_name(cluster), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    end = time.monotonic() + timeout
    while True:
        reply = httpx.post(f"{cluster.url}/v1/completions", json=body, headers=AUTH, timeout=120)
        if reply.status_code == 200:
            return reply.json()
        assert time.monotonic() < end, reply.text
        time.sleep(0.5)


def node_address(cluster: LocalCluster, node: str) -> str:
    return heartbeats(cluster, 1.0)[node].address


class TestTransferNodeRestarted:
    def test_reuse_is_back_within_seconds_of_the_restart(self, cluster: LocalCluster) -> None:
        prompt = tokens(PROMPT_TOKENS, seed=31)
        complete(cluster, prompt)
        assert cached(complete(cluster, prompt)) == REUSED
        before = node_address(cluster, "transfer-0")
        cluster.kill("transfer-0")
        restart(cluster, "transfer-0")
        back = wait_live(cluster, {"transfer-0"})
        assert node_address(cluster, "transfer-0") != before  # a new port: the old address refuses
        reuse_comes_back(cluster, prompt, back)

    def test_rejoined_even_when_nobody_announced_the_old_run_gone(self, cluster: LocalCluster) -> None:
        # The conductor is down while the node restarts, and the one that starts after it never knew the
        # old run: no InstanceDown comes, the cache-manager only hears heartbeats of a new incarnation.
        prompt = tokens(PROMPT_TOKENS, seed=32)
        complete(cluster, prompt)
        assert cached(complete(cluster, prompt)) == REUSED
        cluster.kill("conductor-0")
        cluster.kill("transfer-0")
        restart(cluster, "transfer-0")
        wait_live(cluster, {"transfer-0"})
        restart(cluster, "conductor-0")
        wait_live(cluster, {"conductor-0"})
        served = first_served(cluster, prompt)
        assert cached(served) == 0  # the new run's segment is empty
        reuse_comes_back(cluster, prompt, time.monotonic())


class TestCorruptBlock:
    def test_a_damaged_block_is_dropped_written_again_and_reused(self, cluster: LocalCluster,
                                                                 tiny_model_dir: Path) -> None:
        prompt = tokens(PROMPT_TOKENS, seed=33)
        complete(cluster, prompt)
        assert cached(complete(cluster, prompt)) == REUSED
        assert corrupt_every_dram_block(cluster, "transfer-0", node_address(cluster, "transfer-0")) >= REUSED // BLOCK
        damaged = complete(cluster, prompt)
        assert cached(damaged) == 0  # recomputed, never served
        assert damaged["choices"][0]["text"] == reference_text(tiny_model_dir, prompt, MAX_TOKENS)
        again = complete(cluster, prompt)
        assert cached(again) == REUSED  # written again by the recompute, and intact
        assert again["choices"][0]["text"] == damaged["choices"][0]["text"]
