"""Requests through the live services give exactly the reference model's output."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from halfmoon.deploy.local import LocalCluster
from tests.e2e.conftest import API_KEY, AUTH, REFERENCE_DTYPE, model_name, reference_text, start_cluster

MAX_TOKENS = 16


def prompts(model_dir: Path, count: int = 8) -> list[list[int]]:
    """Token-id prompts from 1 token to several KV blocks (block size 16)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(11)
    lengths = [1, 5, 16, 17, 33, 50, 70, 100][:count]
    return [[rng.randrange(3, len(tokenizer)) for _ in range(n)] for n in lengths]


async def complete_all(cluster: LocalCluster, batch: list[list[int]]) -> list[str]:
    name = model_name(cluster)
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=120) as client:
        replies = await asyncio.gather(*[
            client.post("/v1/completions", json={"model": name, "prompt": p, "max_tokens": MAX_TOKENS,
                                                 "temperature": 0})
            for p in batch
        ])
    for reply in replies:
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-request-id"]
    return [r.json()["choices"][0]["text"] for r in replies]


class TestGreedyThroughServices:
    async def test_two_prefill_two_decode(self, cluster_2p2d: LocalCluster, tiny_model_dir: Path) -> None:
        batch = prompts(tiny_model_dir)
        texts = await complete_all(cluster_2p2d, batch)
        assert texts == [reference_text(tiny_model_dir, p, MAX_TOKENS) for p in batch]

    def test_one_prefill_one_decode_whole_block(self, tiny_model_dir: Path, tmp_path: Path) -> None:
        """The hand-off with one batch of every layer (the 2p2d cluster hands off layer by layer)."""
        cluster = start_cluster(tiny_model_dir, tmp_path, env={"HALFMOON_LAYERWISE_HANDOFF": "false"},
                                dtype=REFERENCE_DTYPE, prefill=1, decode=1)
        try:
            batch = prompts(tiny_model_dir)
            texts = asyncio.run(complete_all(cluster, batch))
        finally:
            cluster.stop()
        assert texts == [reference_text(tiny_model_dir, p, MAX_TOKENS) for p in batch]


class TestOpenAIClient:
    @pytest.fixture
    def client(self, cluster_2p2d: LocalCluster) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{cluster_2p2d.url}/v1", api_key=API_KEY, max_retries=0)

    def test_completion_stream_matches_non_stream(self, client: openai.OpenAI, cluster_2p2d: LocalCluster) -> None:
        name = model_name(cluster_2p2d)
        whole = client.completions.create(model=name, prompt="the hot prefix block", max_tokens=20, temperature=0)
        streamed = client.completions.create(model=name, prompt="the hot prefix block", max_tokens=20,
                                             temperature=0, stream=True)
        text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
        assert whole.choices[0].text and text == whole.choices[0].text
        assert whole.usage.completion_tokens == 20 or whole.choices[0].finish_reason == "stop"

    def test_chat_stream_matches_non_stream(self, client: openai.OpenAI, cluster_2p2d: LocalCluster) -> None:
        name = model_name(cluster_2p2d)
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello moon"}]
        whole = client.chat.completions.create(model=name, messages=messages, max_tokens=20, temperature=0)
        streamed = client.chat.completions.create(model=name, messages=messages, max_tokens=20, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
        chunks = list(streamed)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    def test_seeded_sampling_is_reproducible(self, client: openai.OpenAI, cluster_2p2d: LocalCluster) -> None:
        name = model_name(cluster_2p2d)
        runs = [client.completions.create(model=name, prompt="cache", max_tokens=16, temperature=1.0, seed=s).choices[0].text
                for s in (5, 5, 6)]
        assert runs[0] == runs[1] != runs[2]

    def test_bad_request_is_a_clean_error(self, client: openai.OpenAI, cluster_2p2d: LocalCluster) -> None:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=model_name(cluster_2p2d), prompt="x", max_tokens=0)
        assert "max_tokens" in str(caught.value)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="x", max_tokens=3)


BAD_BODIES: list[tuple[str | dict, str]] = [
    ("{not json", "json"),
    ({"model": "MODEL", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "MODEL", "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"model": "nope", "prompt": "x"}, "model"),
    ({"model": "MODEL", "messages": []}, "messages"),
    ({"model": "MODEL", "prompt": [1, 2] * 20000, "max_tokens": 4}, "context"),
]


class TestBadInputFlood:
    async def test_good_requests_survive_a_flood_of_bad_ones(self, cluster_2p2d: LocalCluster,
                                                              tiny_model_dir: Path) -> None:
        name = model_name(cluster_2p2d)
        good = prompts(tiny_model_dir, 4)
        expected = [reference_text(tiny_model_dir, p, MAX_TOKENS) for p in good]

        async def bad(client: httpx.AsyncClient, body: str | dict, word: str) -> None:
            endpoint = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
            if isinstance(body, dict):
                body = httpx.Request("POST", "/", json={k: (name if v == "MODEL" else v) for k, v in body.items()}).content.decode()
            reply = await client.post(endpoint, content=body, headers={"content-type": "application/json"})
            assert 400 <= reply.status_code < 500, reply.text
            error = reply.json()["error"]
            assert word in (error["message"] + str(error.get("param"))).lower()

        async with httpx.AsyncClient(base_url=cluster_2p2d.url, headers=AUTH, timeout=120) as client:
            flood = [bad(client, body, word) for _ in range(8) for body, word in BAD_BODIES]
            good_calls = [client.post("/v1/completions", json={"model": name, "prompt": p, "max_tokens": MAX_TOKENS,
                                                               "temperature": 0}) for p in good]
            results = await asyncio.gather(*good_calls, *flood)
        assert not [(r.status_code, r.text) for r in results[: len(good)] if r.status_code != 200]
        assert [r.json()["choices"][0]["text"] for r in results[: len(good)]] == expected
