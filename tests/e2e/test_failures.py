"""An instance killed mid-request fails only that request, quickly; the rest of the system serves on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol.subjects import Subjects

from tests.e2e.conftest import AUTH, admin_nats, model_name, start_cluster

FAILURE_DEADLINE_S = 15.0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Shared: the decode test leaves 2 prefill + 1 decode, which the prefill test then cuts to 1 + 1."""
    cluster = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("run-kill"), prefill=2, decode=2)
    yield cluster
    cluster.stop()


async def kill_when_submitted(cluster: LocalCluster, subject: str, instance_id: str,
                              watching: asyncio.Event) -> None:
    """Kill ``instance_id`` the moment a request is submitted to it (seen on its NATS subject)."""
    nc = await admin_nats(cluster)
    arrived = asyncio.Event()

    async def on_submit(_msg) -> None:  # type: ignore[no-untyped-def]
        arrived.set()

    await nc.subscribe(subject, cb=on_submit)
    await nc.flush()
    watching.set()
    try:
        await asyncio.wait_for(arrived.wait(), 60)
        cluster.kill(instance_id)
    finally:
        await nc.close()


async def request(client: httpx.AsyncClient, body: dict) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    reply = await client.post("/v1/completions", json=body)
    return reply, time.monotonic() - started


async def run_kill(cluster: LocalCluster, role: str, body: dict, victims: int) -> list[tuple[httpx.Response, float]]:
    subjects = Subjects("e2e")
    subject = subjects.prefill_submit(f"{role}-0") if role == "prefill" else subjects.decode_submit(f"{role}-0")
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=120) as client:
        watching = asyncio.Event()
        killer = asyncio.create_task(kill_when_submitted(cluster, subject, f"{role}-0", watching))
        await watching.wait()
        results = await asyncio.gather(*[request(client, body) for _ in range(victims)])
        await killer
    return results


def assert_failed_fast_and_cleanly(results: list[tuple[httpx.Response, float]]) -> None:
    failed = [(r, t) for r, t in results if r.status_code != 200]
    assert failed, "the killed instance held none of the requests"
    for reply, elapsed in failed:
        assert reply.status_code >= 500 and reply.json()["error"]["message"]
        assert elapsed < FAILURE_DEADLINE_S


def assert_still_serving(cluster: LocalCluster) -> None:
    name = model_name(cluster)
    for _ in range(4):
        reply = httpx.post(f"{cluster.url}/v1/completions", headers=AUTH, timeout=60,
                           json={"model": name, "prompt": "after the crash", "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200, reply.text


class TestInstanceKilledMidRequest:
    def test_decode_killed_while_generating(self, cluster: LocalCluster) -> None:
        body = {"model": model_name(cluster), "prompt": "a long answer", "max_tokens": 1500, "temperature": 0,
                "ignore_eos": True}
        results = asyncio.run(run_kill(cluster, "decode", body, victims=4))
        assert_failed_fast_and_cleanly(results)
        assert_still_serving(cluster)

    def test_prefill_killed_while_computing(self, cluster: LocalCluster) -> None:
        body = {"model": model_name(cluster), "prompt": "moon " * 6000, "max_tokens": 4, "temperature": 0}
        results = asyncio.run(run_kill(cluster, "prefill", body, victims=4))
        assert_failed_fast_and_cleanly(results)
        assert_still_serving(cluster)
