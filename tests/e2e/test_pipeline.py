"""Chunked pipeline-parallel prefill (CPP) through the whole deployment: the conductor pipelines a long
prompt over the two prefill instances (its threshold set low), the gateway passes the stages on, and the
answer is exactly the reference model's; a short prompt is prefilled by one instance."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol import codecs
from halfmoon.protocol.pipeline import StageWork
from tests.e2e.conftest import AUTH, REFERENCE_DTYPE, admin_nats, model_name, reference_text, start_cluster

MAX_TOKENS = 12
# Pipelining whatever it predicts faster from 96 tokens on, with a
# prior speed (the first request is the long one: nothing measured yet) at which compute, not the hop's
# fixed latency, dominates a chunk's time; the tiny model's hidden states are 256 float32 a token.
CPP_ENV = {"HALFMOON_CPP_STAGES": "2", "HALFMOON_CPP_MIN_TOKENS": "96",
           "HALFMOON_CPP_RESCUE_ONLY": "false", "HALFMOON_CPP_CHUNK_TOKENS": "32", "HALFMOON_PREFILL_CHUNK_SIZE": "32",
           "HALFMOON_PREFILL_TOKENS_PER_S": "1000", "HALFMOON_CPP_HOP_BYTES_PER_TOKEN": "1024"}


@pytest.fixture(scope="module")
def cluster_cpp(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("run-cpp"), env=CPP_ENV, dtype=REFERENCE_DTYPE,
                            prefill=2, decode=1)
    yield cluster
    cluster.stop()


async def complete(cluster: LocalCluster, prompt: list[int]) -> tuple[str, list[StageWork]]:
    """The completion's text, and the stage chunks that crossed NATS while it ran."""
    nc = await admin_nats(cluster)
    seen: list[StageWork] = []

    async def on_stage(msg) -> None:  # type: ignore[no-untyped-def]
        seen.append(codecs.STAGE_WORK.decode(msg.data))

    await nc.subscribe("e2e.v1.prefill.*.stage", cb=on_stage)
    await nc.flush()
    try:
        async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=180) as client:
            reply = await client.post("/v1/completions", json={"model": model_name(cluster), "prompt": prompt,
                                                               "max_tokens": MAX_TOKENS, "temperature": 0})
        assert reply.status_code == 200, reply.text
        await nc.flush()
    finally:
        await nc.close()
    return reply.json()["choices"][0]["text"], seen


class TestPipelinedPrefillThroughServices:
    def test_long_prompt_is_pipelined_and_exact_short_one_is_not(self, cluster_cpp: LocalCluster,
                                                                 tiny_model_dir: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        rng = random.Random(5)
        long, short = ([rng.randrange(3, len(tokenizer)) for _ in range(n)] for n in (150, 40))
        text, stages = asyncio.run(complete(cluster_cpp, long))
        assert text == reference_text(tiny_model_dir, long, MAX_TOKENS)
        assert [work.index for work in stages] == list(range(5))  # 150 tokens in 32-token chunks, to stage 1
        assert len({work.stages for work in stages}) == 1 and stages[-1].last and stages[-1].blocks
        text, stages = asyncio.run(complete(cluster_cpp, short))
        assert text == reference_text(tiny_model_dir, short, MAX_TOKENS)
        assert stages == []
