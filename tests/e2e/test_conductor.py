"""The live Conductor: requests follow the cached prefix, and a burst beyond capacity (a TTFT SLO set in
prefills this CPU measured) is rejected before prefill."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol import codecs
from halfmoon.protocol.subjects import Subjects
from tests.e2e.conftest import AUTH, admin_nats, model_name, start_cluster

PROMPT_TOKENS = 2000
# The TTFT SLO in prefills of one PROMPT_TOKENS prompt, timed here with both prefill instances busy: two
# such prompts queued on an instance fit, a third does not, so a burst of BURST overloads both instances
# on any CPU, however fast it prefills.
SLO_IN_PREFILLS = 2.5
BURST = 20
# What the conductor accepts is predicted to start within the SLO; other work sharing the CPU can slow it
# between the prediction and the first token (one accepted prompt came 1% late when a compose stack started
# next door during the burst, 47% late while a whole second test suite ran beside it, 59% late beside a
# busy loop and four vLLM processes starting), so first tokens are held to the SLO with this much slack:
# what this test checks is that the burst is turned away before prefill, not how close the predictions come
# (benchmarks.peers measures that). Accepting the whole burst would put its last first tokens near 8 SLOs.
LATE_SLACK = 2.0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Predictions calibrated to the first tokens delivered: five processes share two cores here, and
    # uncalibrated the conductor accepted a second long prompt per instance, predicted at 2.5 s and
    # delivered at 2.7-3.8 s, against a 3 s SLO.
    # No instance dies here: a prefill instance whose heartbeats a loaded CPU delays by seconds is not taken
    # for dead (its requests were migrated and then rejected, after a prefill had seen them).
    env = {"HALFMOON_TTFT_SLO_S": "600", "HALFMOON_PREFILL_TOKENS_PER_S": "1000", "HALFMOON_TTFT_CALIBRATION_S": "120",
           "HALFMOON_INSTANCE_TIMEOUT_S": "30"}
    cluster = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("run-conductor"), env=env, prefill=2, decode=1)
    try:
        prefill_s = asyncio.run(timed_prefill(cluster))
        # The conductor restarts with the SLO in this CPU's seconds, and the measured speed as its prior,
        # so its first predictions are this CPU's too.
        restart_conductor(cluster, {"HALFMOON_TTFT_SLO_S": f"{SLO_IN_PREFILLS * prefill_s:.3f}",
                                    "HALFMOON_PREFILL_TOKENS_PER_S": f"{PROMPT_TOKENS / prefill_s:.1f}"})
        yield cluster
    finally:
        cluster.stop()


def ttft_slo_s(cluster: LocalCluster) -> float:
    return float(cluster.extra_env["HALFMOON_TTFT_SLO_S"])


async def first_token(client: httpx.AsyncClient, model: str, prompt: list[int]) -> tuple[httpx.Response, float | None]:
    """The reply to one streamed completion, and the seconds to its first token (None: not served)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    started = time.monotonic()
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        first = None
        if reply.status_code != 200:
            await reply.aread()
            return reply, None
        async for line in reply.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - started
    return reply, first


async def timed_prefill(cluster: LocalCluster) -> float:
    """Seconds to the first token of a PROMPT_TOKENS prompt with both prefill instances busy (the second
    of two rounds: the first pays for whatever warms up on first use)."""
    name = model_name(cluster)
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=120) as client:
        for round_seed in (50, 60):
            timed = await asyncio.gather(*[first_token(client, name, draw(PROMPT_TOKENS, round_seed + i))
                                           for i in range(2)])
            assert [r.status_code for r, _ in timed] == [200, 200], [r.text for r, _ in timed]
    return max(t for _, t in timed if t is not None)


def restart_conductor(cluster: LocalCluster, env: dict[str, str]) -> None:
    """Stop the conductor, start it again with ``env`` added, and return once it schedules again."""
    old = cluster.procs["conductor-0"]
    old.terminate()
    old.wait(timeout=30)
    cluster.extra_env.update(env)
    cluster.start_instance(cluster.specs["conductor-0"], "conductor-0")
    name = model_name(cluster)

    def schedules() -> bool:
        reply = httpx.post(f"{cluster.url}/v1/completions", headers=AUTH, timeout=30,
                           json={"model": name, "prompt": draw(8, seed=0), "max_tokens": 1})
        return reply.status_code == 200

    deadline = time.monotonic() + 60
    while not (cluster.read_ready("conductor-0") and schedules()):
        assert time.monotonic() < deadline, "the restarted conductor did not schedule within 60 s"
        time.sleep(0.2)  # the interval between polls of a condition, not a synchronisation


class SubmitWatch:
    """Records which prefill instance each request id was submitted to, from the NATS subjects."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.where: dict[str, str] = {}

    async def __aenter__(self) -> SubmitWatch:
        self.nc = await admin_nats(self.cluster)

        async def on_submit(msg) -> None:  # type: ignore[no-untyped-def]
            request = codecs.PREFILL_REQUEST.decode(msg.data)
            self.where[request.request_id] = msg.subject.split(".")[-3]  # prefill.{instance}.submit.{gateway}

        await self.nc.subscribe(Subjects("e2e").prefill_submit_any, cb=on_submit)
        await self.nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.flush()
        await self.nc.close()


def draw(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(count)]


class TestCacheAwareRouting:
    async def test_requests_sharing_a_prefix_go_to_its_holder(self, cluster: LocalCluster) -> None:
        name = model_name(cluster)
        prefix = draw(400, seed=1)
        async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=120) as client, SubmitWatch(cluster) as watch:
            async def send(prompt: list[int]) -> httpx.Response:
                reply = await client.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 4,
                                                                   "temperature": 0})
                assert reply.status_code == 200, reply.text
                return reply

            first = await send(prefix + draw(10, seed=2))
            holder_replies = [await send(prefix + draw(20 + i, seed=10 + i)) for i in range(4)]
            other = await send(draw(300, seed=3))  # unrelated prompt: free to go anywhere
        holder = watch.where[first.headers["x-request-id"]]
        assert [watch.where[r.headers["x-request-id"]] for r in holder_replies] == [holder] * 4
        for reply in holder_replies:  # only the unshared tokens were computed
            usage = reply.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == 400 // 16 * 16
        assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


class TestEarlyRejection:
    async def test_burst_beyond_capacity_is_rejected_before_prefill(self, cluster: LocalCluster) -> None:
        name = model_name(cluster)
        slo_s = ttft_slo_s(cluster)
        async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=120) as client, SubmitWatch(cluster) as watch:
            # the conductor measures long prompts with both prefill instances busy, as they are in the burst
            warm_up = await asyncio.gather(*[first_token(client, name, draw(PROMPT_TOKENS, 70 + i)) for i in range(2)])
            assert [r.status_code for r, _ in warm_up] == [200, 200], [r.text for r, _ in warm_up]
            results = await asyncio.gather(*[first_token(client, name, draw(PROMPT_TOKENS, 100 + i))
                                             for i in range(BURST)])
        rejected = [r for r, _ in results if r.status_code == 429]
        accepted = [(r, t) for r, t in results if r.status_code == 200]
        assert rejected and accepted, ([r.status_code for r, _ in results], slo_s)
        assert len(rejected) + len(accepted) == len(results)
        for reply in rejected:
            assert float(reply.headers["retry-after"]) > 0
            assert "ttft" in reply.json()["error"]["message"].lower()
            assert reply.headers["x-request-id"] not in watch.where  # no prefill ever saw it
        for _, delivered in accepted:
            assert delivered is not None and delivered <= LATE_SLACK * slo_s, (delivered, slo_s)
