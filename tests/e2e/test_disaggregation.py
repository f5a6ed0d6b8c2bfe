"""Per-request disaggregation, live: 1 prefill + 1 decode + 1 aggregated instance and the tiny model.

Beside a request decoding on the aggregated instance, a short prompt is served whole there (its prefill
adds little to that batch's steps) and a long one is handed off (its prefill would slow every token of
the batch more than a hand-off costs); greedy output is the reference model's either way, and the long
prompts served whole (a conductor told a hand-off costs 1,000 s) give the same text as handed off.

Why the choice does not hang on this CPU's speed: the conductor's prefill model is its prior rescaled to
the prefills it has seen (too few here for a fit), so it is linear in the new tokens, and beside a batch
of ``b`` (1, or 2 while an earlier request's end is on its way) the choice compares ``b * prefill`` with
``KV transfer + 100 ms`` (the hand-off overhead set here). The 4-token prompts are served whole unless
their prefill is predicted at more than 50 ms (about 8 ms on a loaded 2-core machine); the 6,000-token
ones are handed off unless predicted under about 115 ms, where the rescaled prior puts them at 1,500
times a 4-token prefill, or at what the first one measured (0.4-3 s for the tiny model on a CPU). The
TTFT and TBT SLOs are generous, so the cost decides, not a predicted miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol import codecs
from halfmoon.protocol.subjects import Subjects
from halfmoon.telemetry.jsonl import read_spans
from tests.e2e.conftest import AUTH, REFERENCE_DTYPE, admin_nats, model_name, reference_text, start_cluster
from tests.e2e.test_conductor import restart_conductor

MAX_TOKENS = 8
SHORT, LONG = 4, 6000
BACKGROUND_TOKENS = 12000  # decoding far longer than the prompts below take, whatever the CPU


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    env = {"HALFMOON_TTFT_SLO_S": "600", "HALFMOON_TBT_SLO_S": "30", "HALFMOON_HANDOFF_OVERHEAD_S": "0.1",
           "HALFMOON_INSTANCE_TIMEOUT_S": "30"}
    cluster = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("run-disaggregation"), env=env,
                            dtype=REFERENCE_DTYPE, prefill=1, decode=1, aggregated=1)
    yield cluster
    cluster.stop()


def draw(model_dir: Path, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    return [rng.randrange(3, vocab) for _ in range(length)]


@contextlib.asynccontextmanager
async def watch_placements(cluster: LocalCluster) -> AsyncIterator[dict[str, tuple[str, str]]]:
    """(prefill instance, decode instance) of every placement, by request id, from the conductor's Placed."""
    placements: dict[str, tuple[str, str]] = {}
    nc = await admin_nats(cluster)

    async def on_placed(msg) -> None:  # type: ignore[no-untyped-def]
        placed = codecs.PLACED.decode(msg.data)
        placements[placed.request_id] = (placed.prefill_instance, placed.decode_instance)

    try:
        await nc.subscribe(Subjects("e2e").placed, cb=on_placed)
        await nc.flush()
        yield placements
    finally:
        await nc.flush()
        await nc.close()


@contextlib.asynccontextmanager
async def decoding_on_the_aggregated_instance(client: httpx.AsyncClient, name: str, prompt: list[int],
                                              placements: dict[str, tuple[str, str]]) -> AsyncIterator[None]:
    """A long generation, streaming until the block ends (closing the stream cancels it). It starts on an
    idle deployment, so it is served whole: nothing there to slow down, a hand-off to pay for."""
    body = {"model": name, "prompt": prompt, "max_tokens": BACKGROUND_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        lines = reply.aiter_lines()  # held: a line iterator left to the garbage collector closes the stream
        async for line in lines:
            if line.startswith("data: {"):
                break
        assert placements[reply.headers["x-request-id"]] == ("aggregated-0", "aggregated-0")
        yield


def schedule_attributes(cluster: LocalCluster, request_id: str, deadline_s: float = 30.0) -> dict:
    """The conductor's schedule span of the request's trace, from the span file (polled: each service
    exports its spans in its own batches)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        spans = read_spans(cluster.trace_file) if cluster.trace_file.exists() else []
        roots = [s for s in spans if s["service"] == "gateway" and s["attributes"].get("halfmoon.request_id") == request_id]
        scheduled = [s for s in spans if roots and s["trace_id"] == roots[0]["trace_id"]
                     and s["name"] == "conductor.schedule"]
        if scheduled:
            return scheduled[0]["attributes"]
        time.sleep(0.2)
    raise AssertionError(f"no conductor.schedule span for {request_id}")


async def complete(client: httpx.AsyncClient, name: str, prompt: list[int]) -> tuple[str, str]:
    """(request id, text) of a greedy completion."""
    reply = await client.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                       "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.headers["x-request-id"], reply.json()["choices"][0]["text"]


class TestPerRequestDisaggregation:
    async def test_short_prompts_are_served_whole_and_long_ones_handed_off_with_the_same_greedy_output(
            self, cluster: LocalCluster, tiny_model_dir: Path) -> None:
        name = model_name(cluster)
        shorts = [draw(tiny_model_dir, SHORT, seed) for seed in (1, 2, 3)]
        longs = [draw(tiny_model_dir, LONG, seed) for seed in (11, 12)]
        background = draw(tiny_model_dir, SHORT, 0)
        async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=300) as client, \
                watch_placements(cluster) as placements, \
                decoding_on_the_aggregated_instance(client, name, background, placements):
            short_served = [await complete(client, name, p) for p in shorts]
            long_served = [await complete(client, name, p) for p in longs]
        assert [placements[rid] for rid, _ in short_served] == [("aggregated-0", "aggregated-0")] * 3
        assert [placements[rid] for rid, _ in long_served] == [("prefill-0", "decode-0")] * 2
        assert [text for _, text in short_served] == [reference_text(tiny_model_dir, p, MAX_TOKENS) for p in shorts]
        assert [text for _, text in long_served] == [reference_text(tiny_model_dir, p, MAX_TOKENS) for p in longs]
        # the schedule span records the choice and both predicted costs
        for (rid, _), serving in [*((s, "whole") for s in short_served), *((s, "handoff") for s in long_served)]:
            attributes = schedule_attributes(cluster, rid)
            assert attributes["halfmoon.serving"] == serving, attributes
            cheaper, dearer = ("whole", "handoff") if serving == "whole" else ("handoff", "whole")
            assert attributes[f"halfmoon.cost.{cheaper}_s"] < attributes[f"halfmoon.cost.{dearer}_s"], attributes

        # the same long prompts served whole: a conductor told that a hand-off costs 1,000 s never hands off
        await asyncio.to_thread(restart_conductor, cluster, {"HALFMOON_HANDOFF_OVERHEAD_S": "1000"})
        async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=300) as client, \
                watch_placements(cluster) as placements:
            whole_served = [await complete(client, name, p) for p in longs]
        assert [placements[rid] for rid, _ in whole_served] == [("aggregated-0", "aggregated-0")] * 2
        assert [text for _, text in whole_served] == [text for _, text in long_served]
