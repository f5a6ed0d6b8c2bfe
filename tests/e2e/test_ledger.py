"""The Conductor's queue estimates drain however requests end: after a burst of placements never taken,
requests rejected, streams dropped by their clients and requests served, its ledger holds nothing and an
idle system is predicted idle again (the bug: it went on predicting a long queue and rejecting)."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol import SamplingParams, ScheduleAccepted, ScheduleRejected, ScheduleRequest, codecs
from halfmoon.protocol.subjects import Subjects
from halfmoon.runtime import request
from tests.e2e.conftest import AUTH, admin_nats, model_name, start_cluster

TTFT_SLO_S = 3.0
PRIOR_TOKENS_PER_S = 1000  # pessimistic for this model: a 600-token prompt is predicted at 0.6 s


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    env = {"HALFMOON_TTFT_SLO_S": str(TTFT_SLO_S), "HALFMOON_PREFILL_TOKENS_PER_S": str(PRIOR_TOKENS_PER_S),
           "HALFMOON_LEDGER_GRACE_S": "1.0", "HALFMOON_METRICS_PORT": "-1",
           "HALFMOON_TTFT_CALIBRATION_S": "120"}
    cluster = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("run-ledger"), env=env, prefill=1, decode=1)
    yield cluster
    cluster.stop()


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(length)]


def conductor_metrics(cluster: LocalCluster) -> dict[tuple[str, tuple], float]:
    port = next(p for iid, p in cluster.metrics_ports.items() if iid.startswith("conductor"))
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("halfmoon_conductor_")}


def outstanding(cluster: LocalCluster) -> dict[str, float]:
    """Requests and predicted seconds the conductor's ledger holds, per instance, in one dict."""
    return {f"{name}[{dict(labels)['instance']}]": v for (name, labels), v in conductor_metrics(cluster).items()
            if name.startswith("halfmoon_conductor_outstanding_")}


async def placement(cluster: LocalCluster, length: int, seed: int) -> ScheduleAccepted | ScheduleRejected:
    """Ask the conductor where a request would go, and never submit it: a placement never taken."""
    nc = await admin_nats(cluster)
    try:
        ask = ScheduleRequest(request_id=f"probe-{uuid.uuid4().hex}", model="m", prompt_len=length,
                              prompt_token_ids=tuple(prompt(length, seed)), sampling=SamplingParams(max_tokens=8),
                              deadline=time.time() + 60)
        reply = await request(nc, Subjects("e2e").schedule, ask, codecs.SCHEDULE_REPLY, 10)
        assert isinstance(reply, ScheduleAccepted | ScheduleRejected), reply
        return reply
    finally:
        await nc.close()


def wait_drained(cluster: LocalCluster, timeout: float) -> dict[str, float]:
    deadline, held = time.monotonic() + timeout, outstanding(cluster)
    while any(held.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        held = outstanding(cluster)
    return held


async def stream(client: httpx.AsyncClient, model: str, seed: int, leave_after_first: bool) -> int:
    body = {"model": model, "prompt": prompt(600, seed), "max_tokens": 32, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return reply.status_code
        async for line in reply.aiter_lines():
            if leave_after_first and line.startswith("data: {"):
                break  # closes the connection with the stream still running
    return reply.status_code


class TestQueueEstimatesDrain:
    async def test_after_a_burst_an_idle_system_is_predicted_idle(self, cluster: LocalCluster) -> None:
        idle = await placement(cluster, 200, seed=0)
        assert isinstance(idle, ScheduleAccepted) and idle.predicted_ttft_ms is not None
        assert wait_drained(cluster, 20) == dict.fromkeys(outstanding(cluster), 0.0)  # the probe itself drained

        # Placements nobody takes pile up until the conductor predicts the SLO missed and rejects.
        ghosts = [await placement(cluster, 600, seed=100 + i) for i in range(12)]
        accepted = [g for g in ghosts if isinstance(g, ScheduleAccepted)]
        assert accepted and len(accepted) < len(ghosts), [type(g).__name__ for g in ghosts]
        assert max(g.predicted_ttft_ms or 0 for g in accepted) > 2 * idle.predicted_ttft_ms
        assert any(v > 0 for v in outstanding(cluster).values())
        assert wait_drained(cluster, 20) == dict.fromkeys(outstanding(cluster), 0.0)
        assert isinstance(await placement(cluster, 200, seed=2), ScheduleAccepted)

        # Then clients: some leave after their first token, some are served, some may be rejected.
        name = model_name(cluster)
        async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=120) as client:
            codes = await asyncio.gather(*[stream(client, name, 200 + i, leave_after_first=i % 2 == 0)
                                           for i in range(12)])
        assert set(codes) <= {200, 429}, codes
        assert 200 in codes, codes

        assert wait_drained(cluster, 30) == dict.fromkeys(outstanding(cluster), 0.0)
        # every served request's first token taught the TTFT calibration; an idle system stays idle after it
        samples = conductor_metrics(cluster)[("halfmoon_conductor_ttft_calibration", (("parameter", "samples"),))]
        assert samples == codes.count(200)
        # the decode instance's heartbeats reported the steps it ran: the decode cost model learned from them
        decode_samples = ("halfmoon_conductor_cost_model", (("figure", "samples"), ("model", "decode")))
        deadline = time.monotonic() + 15
        while conductor_metrics(cluster).get(decode_samples, 0) < 1:
            assert time.monotonic() < deadline, "no decode step sample reached the conductor"
            await asyncio.sleep(0.2)
        after = await placement(cluster, 200, seed=1)
        assert isinstance(after, ScheduleAccepted), after
        assert after.predicted_ttft_ms is not None
        assert after.predicted_ttft_ms <= max(2 * idle.predicted_ttft_ms, idle.predicted_ttft_ms + 500)
        cleared = {dict(labels)["how"]: v for (name, labels), v in conductor_metrics(cluster).items()
                   if name == "halfmoon_conductor_ledger_cleared"}
        assert cleared["reconciled"] >= len(accepted)  # the ghosts
        assert cleared["completed"] > 0 and cleared["cancelled"] > 0, cleared
