"""The official openai client against the gateway: results, streaming, and clean errors."""

from __future__ import annotations

import openai
import pytest
from fake_engine import Script
from test_gateway_generation import TEXT, wait_for


@pytest.fixture
async def client(gateway):
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
async def serving(conductor, cluster, gateway):
    output = tuple(gateway.served.tokenizer.encode(TEXT, add_special_tokens=False))
    await cluster.prefill("p0", Script(output=output, cached_tokens=1))
    await cluster.decode("d0")
    await wait_for(lambda: all(i in conductor.table for i in ("p0", "d0")), "registration")


class TestResults:
    async def test_completions_stream_equals_non_stream(self, client, serving):
        full = await client.completions.create(model="tiny", prompt="hello", max_tokens=64, temperature=0)
        assert full.choices[0].text == TEXT and full.usage.prompt_tokens_details.cached_tokens == 1
        stream = await client.completions.create(
            model="tiny", prompt="hello", max_tokens=64, stream=True, stream_options={"include_usage": True}
        )
        parts, usage = [], None
        async for chunk in stream:
            parts.extend(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        assert "".join(parts) == full.choices[0].text
        assert usage.completion_tokens == full.usage.completion_tokens

    async def test_chat_stream_equals_non_stream(self, client, serving):
        messages = [{"role": "user", "content": "hi"}]
        full = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=64, seed=1, stop=["never"], logprobs=True
        )
        assert full.choices[0].message.content == TEXT and full.choices[0].finish_reason == "stop"
        assert len(full.choices[0].logprobs.content) == full.usage.completion_tokens
        stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == full.choices[0].message.content

    async def test_models(self, client):
        assert [m.id async for m in client.models.list()] == ["tiny"]


class TestCleanErrors:
    async def test_bad_request(self, client):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=0
            )
        assert info.value.status_code == 400 and info.value.param == "max_tokens"
        assert "max_tokens must be at least 1" in info.value.message

    async def test_empty_messages(self, client):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="tiny", messages=[])
        assert info.value.param == "messages"

    async def test_unknown_model(self, client):
        with pytest.raises(openai.NotFoundError) as info:
            await client.completions.create(model="gpt-4o", prompt="x")
        assert info.value.code == "model_not_found"

    async def test_context_length(self, client):
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="tiny", prompt=list(range(5, 400)), max_tokens=4)
        assert info.value.code == "context_length_exceeded"

    async def test_rejection_is_a_rate_limit(self, client, conductor):
        with pytest.raises(openai.RateLimitError) as info:
            await client.completions.create(model="tiny", prompt="x", max_tokens=4)
        assert info.value.response.headers["retry-after"] == "2"

    async def test_mid_stream_failure_raises(self, client, conductor, cluster, gateway):
        await cluster.prefill("p0", Script(output=(10, 11, 12, 13, 14), fail_after=2))
        await cluster.decode("d0")
        await wait_for(lambda: all(i in conductor.table for i in ("p0", "d0")), "registration")
        stream = await client.completions.create(model="tiny", prompt="x", max_tokens=5, stream=True)
        with pytest.raises(openai.APIError, match="engine failed"):
            async for _ in stream:
                pass
