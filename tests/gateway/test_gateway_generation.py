"""Generation through the gateway against scripted engine peers on a real NATS server."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fake_engine import Script

TEXT = "Hello moon — héllo 世界 🌙 done"


def sse_events(raw: str) -> list:
    events = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@pytest.fixture
def output_ids(gateway) -> tuple[int, ...]:
    return tuple(gateway.served.tokenizer.encode(TEXT, add_special_tokens=False))


@pytest.fixture
async def serving(conductor, cluster, output_ids):
    """One scripted prefill and one decode instance, registered with the conductor."""
    await cluster.prefill("p0", Script(output=output_ids, cached_tokens=2))
    await cluster.decode("d0")
    await wait_for(lambda: all(i in conductor.table for i in ("p0", "d0")), "instances registered")
    return cluster


async def wait_for(condition, what: str, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class TestCompletions:
    async def test_non_streamed_text_usage_and_request_id(self, http, serving, output_ids):
        response = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hello there", "max_tokens": 64})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"] == TEXT
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["object"] == "text_completion" and body["model"] == "tiny"
        assert response.headers["x-request-id"] == body["id"]
        usage = body["usage"]
        assert usage["completion_tokens"] == len(output_ids)
        assert usage["prompt_tokens_details"] == {"cached_tokens": 2}
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    async def test_max_tokens_cuts_with_length(self, http, serving, output_ids, gateway):
        body = (await http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3})).json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["choices"][0]["text"] == gateway.served.tokenizer.decode(output_ids[:3])
        assert body["usage"]["prompt_tokens"] == 3

    async def test_streamed_chunks_concatenate_to_full_text_without_broken_characters(self, http, serving):
        request = {
            "model": "tiny",
            "prompt": "hi",
            "max_tokens": 64,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.stream("POST", "/v1/completions", json=request) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = sse_events((await response.aread()).decode())
        assert events[-1] == "[DONE]"
        chunks, usage = events[:-2], events[-2]
        texts = [c["choices"][0]["text"] for c in chunks]
        assert "".join(texts) == TEXT
        assert all("\ufffd" not in t for t in texts)
        assert len(chunks) > 5  # really incremental
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert usage["choices"] == [] and usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 2

    async def test_logprobs_per_token(self, http, serving, output_ids):
        body = (
            await http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4, "logprobs": 0})
        ).json()
        lp = body["choices"][0]["logprobs"]
        assert lp["token_logprobs"] == [-0.5] * 4 and len(lp["tokens"]) == 4

    async def test_sampling_parameters_reach_prefill(self, http, serving):
        await http.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": "x",
                "max_tokens": 5,
                "temperature": 0,
                "top_p": 0.5,
                "seed": 7,
                "stop": ["\n", "END"],
            },
        )
        sampling = serving.hosts[0].service.received[-1].sampling
        assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed, sampling.stop) == (
            5,
            0.0,
            0.5,
            7,
            ("\n", "END"),
        )


class TestChat:
    async def test_chat_applies_the_template(self, http, serving, gateway):
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
        body = (
            await http.post(
                "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_completion_tokens": 64}
            )
        ).json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": TEXT, "refusal": None}
        sent = serving.hosts[0].service.received[-1].prompt_token_ids
        expected = gateway.served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert gateway.served.tokenizer.decode(sent) == expected

    async def test_chat_stream_starts_with_role_and_matches_non_stream(self, http, serving):
        request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=request) as response:
            events = sse_events((await response.aread()).decode())
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == TEXT
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


def httpx_client(gw) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=gw.url, timeout=30)


async def started_gateway(gateway_factory, conductor, cluster, script: Script, prefills=("p0",), **overrides):
    for iid in prefills:
        await cluster.prefill(iid, script)
    await cluster.decode("d0")
    await wait_for(lambda: all(i in conductor.table for i in (*prefills, "d0")), "registration")
    return await gateway_factory(**overrides)


def chat_request(stream: bool = False, max_tokens: int = 64) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


class TestDeadlines:
    """With migrations off (migration_limit=0), every failure ends the request at once; TestMigration covers the rest."""

    async def test_no_first_token_is_504_in_time(self, gateway_factory, conductor, cluster, output_ids):
        gw = await started_gateway(
            gateway_factory, conductor, cluster, Script(output=output_ids, stall_after=0), ttft_timeout_s=0.5,
            migration_limit=0,
        )
        async with httpx_client(gw) as http:
            started = time.monotonic()
            for stream in (False, True):
                response = await http.post("/v1/chat/completions", json=chat_request(stream))
                assert response.status_code == 504
                assert response.json()["error"]["code"] == "timeout"
                assert "first token" in response.json()["error"]["message"]
            assert time.monotonic() - started < 5
        # the abandoned requests were cancelled on the serving path
        prefill = cluster.hosts[0].service
        await wait_for(lambda: len(prefill.cancelled) == 2, "cancellations")

    async def test_stalled_stream_ends_with_an_error_event(self, gateway_factory, conductor, cluster, output_ids):
        gw = await started_gateway(
            gateway_factory, conductor, cluster, Script(output=output_ids, stall_after=3), itl_timeout_s=0.5,
            migration_limit=0,
        )
        async with httpx_client(gw) as http:
            async with http.stream("POST", "/v1/chat/completions", json=chat_request(stream=True)) as response:
                assert response.status_code == 200
                events = sse_events((await response.aread()).decode())
            assert events[-1]["error"]["code"] == "timeout" and "next token" in events[-1]["error"]["message"]
            assert "[DONE]" not in events
            response = await http.post("/v1/chat/completions", json=chat_request())
            assert response.status_code == 504

    async def test_engine_error_event_reaches_the_client(self, gateway_factory, conductor, cluster, output_ids):
        gw = await started_gateway(gateway_factory, conductor, cluster, Script(output=output_ids, fail_after=2),
                                   migration_limit=0)
        async with httpx_client(gw) as http:
            response = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 20})
        assert response.status_code == 500 and response.json()["error"]["message"] == "engine failed"


class TestInstanceDown:
    async def test_decode_crash_fails_the_request_long_before_the_token_deadline(
        self, gateway_factory, conductor, cluster, output_ids
    ):
        gw = await started_gateway(
            gateway_factory, conductor, cluster, Script(output=output_ids, stall_after=2), itl_timeout_s=60.0,
            migration_limit=0,
        )
        async with httpx_client(gw) as http:
            request = asyncio.create_task(
                http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 20, "stream": True})
            )
            prefill = cluster.hosts[0].service
            await wait_for(lambda: prefill.received, "request reached prefill")
            started = time.monotonic()
            await cluster.crash(cluster.hosts[1])  # d0
            response = await asyncio.wait_for(request, 10)
            assert time.monotonic() - started < 5  # conductor timeout 1.5 s, not the 60 s deadline
            events = sse_events(response.text)
            assert events[-1]["error"]["code"] == "instance_down" and "d0" in events[-1]["error"]["message"]

    async def test_prefill_crash_before_first_token_is_503(self, gateway_factory, conductor, cluster, output_ids):
        gw = await started_gateway(
            gateway_factory, conductor, cluster, Script(output=output_ids, stall_after=0), ttft_timeout_s=60.0,
            migration_limit=0,
        )
        async with httpx_client(gw) as http:
            request = asyncio.create_task(http.post("/v1/chat/completions", json=chat_request()))
            await wait_for(lambda: cluster.hosts[0].service.received, "request reached prefill")
            await cluster.crash(cluster.hosts[0])
            response = await asyncio.wait_for(request, 10)
        assert response.status_code == 503 and response.json()["error"]["code"] == "instance_down"

    async def test_prefill_crash_after_first_token_before_hand_off_fails_fast(
        self, gateway_factory, conductor, cluster, output_ids
    ):
        gw = await started_gateway(
            gateway_factory, conductor, cluster, Script(output=output_ids, stall_after=1), itl_timeout_s=60.0,
            migration_limit=0,
        )
        async with httpx_client(gw) as http:
            body = {"model": "tiny", "prompt": "x", "max_tokens": 20, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200  # the first token came, so the stream had started
                started = time.monotonic()
                await cluster.crash(cluster.hosts[0])
                events = sse_events((await response.aread()).decode())
            assert time.monotonic() - started < 5
            assert events[-1]["error"]["code"] == "instance_down" and "p0" in events[-1]["error"]["message"]

    async def test_next_requests_go_to_the_survivor(self, gateway_factory, conductor, cluster, output_ids):
        gw = await started_gateway(
            gateway_factory, conductor, cluster, Script(output=output_ids), prefills=("p0", "p1")
        )
        await cluster.crash(cluster.hosts[0])
        await wait_for(lambda: "p0" not in conductor.table, "p0 dropped")
        async with httpx_client(gw) as http:
            for _ in range(3):
                response = await http.post("/v1/chat/completions", json=chat_request())
                assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == TEXT


class TestMigration:
    """A request whose instance fails is placed again and continues where the client's stream stopped."""

    async def test_decode_crash_mid_stream_resumes_without_duplicates(
        self, gateway_factory, conductor, cluster, output_ids
    ):
        script = Script(output=output_ids, stall_after=3, faulty_attempts=1)
        await cluster.decode("d1")
        gw = await started_gateway(gateway_factory, conductor, cluster, script, itl_timeout_s=60.0)
        await wait_for(lambda: "d1" in conductor.table, "d1 registered")
        prefill = next(h.service for h in cluster.hosts if h.service.instance_id == "p0")
        async with httpx_client(gw) as http:
            body = {"model": "tiny", "prompt": "x", "max_tokens": 64, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                holder = prefill.received[0].decode_instance
                await cluster.crash(next(h for h in cluster.hosts if h.service.instance_id == holder))
                events = sse_events((await response.aread()).decode())
            assert events[-1] == "[DONE]"
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == TEXT
            resumed = prefill.received[-1]
            assert resumed.attempt == 1 and resumed.output_token_ids == tuple(output_ids[:3])
            assert resumed.decode_instance != holder
            assert 'halfmoon_migrations_total{reason="instance_down"}' in (await http.get("/metrics")).text

    async def test_past_the_limit_a_clear_error(self, gateway_factory, conductor, cluster, output_ids):
        gw = await started_gateway(gateway_factory, conductor, cluster, Script(output=output_ids, stall_after=0),
                                   ttft_timeout_s=0.3, migration_limit=1)
        async with httpx_client(gw) as http:
            response = await http.post("/v1/chat/completions", json=chat_request())
        assert response.status_code == 504
        assert "gave up after 1 migrations" in response.json()["error"]["message"]
        assert [r.attempt for r in cluster.hosts[0].service.received] == [0, 1]


class TestSubmitRetry:
    async def test_unavailable_prefill_makes_the_gateway_ask_again(
        self, gateway_factory, conductor, cluster, output_ids
    ):
        refusing = await cluster.prefill("p0", Script(output=output_ids, refuse=True))
        gw = await started_gateway(gateway_factory, conductor, cluster, Script(output=output_ids), prefills=("p1",))
        await wait_for(lambda: "p0" in conductor.table, "p0 registered")
        async with httpx_client(gw) as http:
            response = await http.post("/v1/chat/completions", json=chat_request())
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == TEXT
        assert len(refusing.service.received) == 1  # tried first (tie on load, smaller id), then p1 served it
        assert len(cluster.hosts[1].service.received) == 1


class TestFlood:
    async def test_bad_requests_do_not_disturb_good_ones(self, http, serving):
        bad_bodies = [
            b"{not json",
            b'{"model": "tiny"}',
            b'{"model": "nope", "prompt": "x"}',
            b'{"model": "tiny", "prompt": "x", "max_tokens": 0}',
            b"x" * 20000,
        ]

        async def bad(i: int) -> int:
            return (await http.post("/v1/completions", content=bad_bodies[i % len(bad_bodies)])).status_code

        async def good() -> str:
            response = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 64})
            assert response.status_code == 200
            return response.json()["choices"][0]["text"]

        results = await asyncio.gather(*[bad(i) for i in range(200)], *[good() for _ in range(8)])
        statuses, texts = results[:200], results[200:]
        assert all(400 <= s < 500 for s in statuses)
        assert set(statuses) == {400, 404, 413}
        assert texts == [TEXT] * 8


class TestMetrics:
    async def test_prometheus_counts_requests_and_tokens(self, http, serving, output_ids):
        await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 64})
        await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 0})
        text = (await http.get("/metrics")).text
        assert 'halfmoon_gateway_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
        assert 'halfmoon_gateway_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
        assert f"halfmoon_gateway_completion_tokens_total {float(len(output_ids))}" in text
        assert "halfmoon_gateway_ttft_seconds_count 1.0" in text
        assert "halfmoon_gateway_in_flight 0.0" in text


class TestClientDisconnect:
    async def test_vanished_client_cancels_the_request(self, gateway_factory, conductor, cluster, output_ids):
        gw = await started_gateway(gateway_factory, conductor, cluster, Script(output=output_ids, token_delay_s=0.2))
        async with httpx_client(gw) as http, http.stream(
            "POST", "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 64, "stream": True}
        ) as response:
            request_id = response.headers["x-request-id"]
            async for _ in response.aiter_bytes():
                break  # first chunk, then hang up
        prefill = cluster.hosts[0].service
        await wait_for(lambda: request_id in prefill.cancelled, "CancelRequest for the abandoned stream")
        await wait_for(lambda: gw.client.in_flight == 0, "generation released")
