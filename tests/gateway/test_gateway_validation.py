"""Every kind of bad input gets the right 4xx with an OpenAI-style error body."""

from __future__ import annotations

import json

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    assert response.headers["x-request-id"]
    return error


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **fields}


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "hello", "max_tokens": 4, **fields}


class TestMalformedBodies:
    async def test_malformed_json(self, http):
        error = error_of(
            await http.post(
                CHAT, content=b'{"model": "tiny", "messages": [', headers={"content-type": "application/json"}
            ),
            400,
        )
        assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error"

    async def test_body_that_is_not_an_object(self, http):
        error = error_of(await http.post(COMPLETIONS, json=["tiny", "hello"]), 400)
        assert "object" in error["message"]

    async def test_empty_body(self, http):
        assert error_of(await http.post(COMPLETIONS, content=b""), 400)["code"] == "invalid_json"


class TestUnknownModel:
    @pytest.mark.parametrize("path,body", [(CHAT, chat(model="gpt-9")), (COMPLETIONS, completion(model="gpt-9"))])
    async def test_unknown_model_is_404(self, http, path, body):
        error = error_of(await http.post(path, json=body), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-9" in error["message"]


class TestMessages:
    async def test_missing_messages(self, http):
        body = chat()
        del body["messages"]
        error = error_of(await http.post(CHAT, json=body), 400)
        assert error["param"] == "messages" and error["code"] == "missing_required_parameter"

    async def test_empty_messages(self, http):
        error = error_of(await http.post(CHAT, json=chat(messages=[])), 400)
        assert error["param"] == "messages" and "at least one" in error["message"]

    async def test_unknown_role(self, http):
        error = error_of(await http.post(CHAT, json=chat(messages=[{"role": "wizard", "content": "x"}])), 400)
        assert error["param"] == "messages[0].role"

    async def test_missing_prompt(self, http):
        body = completion()
        del body["prompt"]
        assert error_of(await http.post(COMPLETIONS, json=body), 400)["param"] == "prompt"


class TestWrongTypes:
    @pytest.mark.parametrize(
        ("path", "body", "param"),
        [
            (CHAT, chat(max_tokens="5"), "max_tokens"),
            (CHAT, chat(temperature="hot"), "temperature"),
            (CHAT, chat(stream="yes"), "stream"),
            (CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
            (CHAT, chat(messages={"role": "user"}), "messages"),
            (CHAT, chat(stop=3), "stop"),
            (CHAT, chat(seed=1.5), "seed"),
            (CHAT, chat(model=7), "model"),
            (COMPLETIONS, completion(prompt={"text": "hi"}), "prompt"),
            (COMPLETIONS, completion(max_tokens=True), "max_tokens"),
            (
                COMPLETIONS,
                completion(stream_options={"include_usage": "y"}, stream=True),
                "stream_options.include_usage",
            ),
        ],
    )
    async def test_wrong_type_names_the_parameter(self, http, path, body, param):
        error = error_of(await http.post(path, json=body), 400)
        assert error["param"] == param and error["code"] == "invalid_type"


class TestOutOfRange:
    @pytest.mark.parametrize(
        ("path", "body", "param"),
        [
            (CHAT, chat(max_tokens=0), "max_tokens"),
            (CHAT, chat(max_tokens=-3), "max_tokens"),
            (CHAT, chat(max_completion_tokens=0), "max_completion_tokens"),
            (COMPLETIONS, completion(max_tokens=0), "max_tokens"),
            (CHAT, chat(temperature=2.5), "temperature"),
            (CHAT, chat(top_p=0), "top_p"),
            (CHAT, chat(n=2), "n"),
            (CHAT, chat(stop=["ok", ""]), "stop"),
            (CHAT, chat(stream_options={"include_usage": True}), "stream_options"),
            (CHAT, chat(top_logprobs=3, logprobs=True), "top_logprobs"),
            (COMPLETIONS, completion(logprobs=5), "logprobs"),
            (COMPLETIONS, completion(prompt=["a", "b"]), "prompt"),
            (COMPLETIONS, completion(prompt=[1, "b"]), "prompt"),
            (COMPLETIONS, completion(prompt=[5, 999999]), "prompt"),
            (COMPLETIONS, completion(prompt=""), "prompt"),
            (COMPLETIONS, completion(top_k=2**63), "top_k"),  # no machine integer in the sampler holds it
            (CHAT, chat(seed=2**64 - 1), "seed"),
            (CHAT, chat(seed=-(2**63) - 1), "seed"),
        ],
    )
    async def test_out_of_range_names_the_parameter(self, http, path, body, param):
        assert error_of(await http.post(path, json=body), 400)["param"] == param


class TestContextLength:
    # the gateway fixture caps the context at 256 tokens
    async def test_prompt_longer_than_context(self, http):
        error = error_of(await http.post(COMPLETIONS, json=completion(prompt=list(range(10, 310)))), 400)
        assert error["code"] == "context_length_exceeded" and "256" in error["message"]

    async def test_prompt_plus_max_tokens_over_context(self, http):
        error = error_of(
            await http.post(COMPLETIONS, json=completion(prompt=list(range(10, 210)), max_tokens=100)), 400
        )
        assert error["code"] == "context_length_exceeded"

    async def test_long_chat_conversation(self, http):
        messages = [{"role": "user", "content": "the cache block prefix token model " * 100}]
        error = error_of(await http.post(CHAT, json=chat(messages=messages, max_tokens=None)), 400)
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"


    async def test_exactly_the_context_passes(self, http):
        # 200 prompt ids + 56 = 256: the engine accepts it too (prefill and decode count it the same way)
        response = await http.post(COMPLETIONS, json=completion(prompt=list(range(10, 210)), max_tokens=56))
        assert error_of(response, 503)["code"] == "unavailable"  # validated, then no conductor here


class TestDeepNesting:
    async def test_deep_unknown_field_is_400_not_a_recursion_error(self, http):
        # 7,000 deep (under this gateway's 16 KiB body limit; the guard's own test goes to 100,000)
        body = b'{"model": "tiny", "prompt": "hi", "extra": ' + b"[" * 7000 + b"]" * 7000 + b"}"
        error = error_of(await http.post(COMPLETIONS, content=body, headers={"content-type": "application/json"}), 400)
        assert error["code"] == "nesting_too_deep"

    async def test_deep_objects_in_a_known_field(self, http):
        content = {"type": "text", "text": "x"}
        for _ in range(70):
            content = {"type": "text", "text": "x", "inner": content}
        error = error_of(await http.post(CHAT, json=chat(messages=[{"role": "user", "content": [content]}])), 400)
        assert error["code"] == "nesting_too_deep"


class TestStopTokenIds:
    @pytest.mark.parametrize("ids", [[999_999], [-1], [3, 10**12]])
    async def test_outside_the_vocabulary(self, http, ids):
        error = error_of(await http.post(COMPLETIONS, json=completion(stop_token_ids=ids)), 400)
        assert error["param"] == "stop_token_ids" and "vocabulary" in error["message"]

    async def test_too_many(self, http):
        error = error_of(await http.post(COMPLETIONS, json=completion(stop_token_ids=list(range(65)))), 400)
        assert error["param"] == "stop_token_ids"

    async def test_not_ints(self, http):
        error = error_of(await http.post(CHAT, json=chat(stop_token_ids=["eos"])), 400)
        assert error["param"] == "stop_token_ids[0]" and error["code"] == "invalid_type"


class TestOverNatsMaxPayload:
    async def test_stop_strings_that_no_nats_message_can_carry(self, gateway_factory):
        gateway = await gateway_factory(max_body_bytes=4 << 20)
        stops = ["s" * 100_000 + str(i) for i in range(16)]  # 1.6 MB: under the body limit, over NATS's 1 MiB
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            error = error_of(await client.post(COMPLETIONS, json=completion(stop=stops)), 413)
        assert error["code"] == "request_too_large" and "message bus" in error["message"]


class TestOversizedBody:
    # the gateway fixture accepts at most 16 KiB
    async def test_declared_length_over_limit(self, http):
        body = json.dumps(completion(prompt="x" * 20000)).encode()
        error = error_of(await http.post(COMPLETIONS, content=body), 413)
        assert error["code"] == "request_too_large"

    async def test_chunked_body_over_limit(self, http):
        async def chunks():
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(40):
                yield b"y" * 1000
            yield b'"}'

        assert error_of(await http.post(COMPLETIONS, content=chunks()), 413)["code"] == "request_too_large"


class TestRoutes:
    async def test_unknown_route_is_openai_shaped(self, http):
        assert error_of(await http.get("/v1/engines"), 404)["code"] == "not_found"

    async def test_wrong_method(self, http):
        error_of(await http.get(CHAT), 405)

    async def test_models_lists_the_served_model(self, http):
        body = (await http.get("/v1/models")).json()
        assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["tiny"]
        assert body["data"][0]["max_model_len"] == 256

    async def test_health(self, http):
        response = await http.get("/health")
        assert response.status_code == 200 and response.json() == {"status": "ok"}


class TestBackendRefusals:
    async def test_conductor_rejection_is_429_with_retry_after(self, gateway_factory, conductor):
        gateway = await gateway_factory(instance_wait_s=0)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            error = error_of(await http.post(CHAT, json=chat()), 429)
            assert error["type"] == "rate_limit_error" and "no_prefill_instance" in error["message"]
            response = await http.post(COMPLETIONS, json=completion())
        assert response.status_code == 429 and response.headers["retry-after"] == "2"

    async def test_no_instance_is_waited_for_until_the_deadline(self, gateway_factory, conductor):
        gateway = await gateway_factory(instance_wait_s=30, ttft_timeout_s=1.5)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            error = error_of(await http.post(CHAT, json=chat()), 429)
            metrics = (await http.get("/metrics")).text
        assert "no_prefill_instance" in error["message"]
        retries = [line for line in metrics.splitlines() if line.startswith("halfmoon_schedule_retries_total ")]
        assert retries and float(retries[0].split()[1]) >= 1  # asked again while it waited, then gave up

    async def test_not_ready_without_instances_though_live(self, http, conductor):
        assert (await http.get("/health")).status_code == 200
        response = await http.get("/ready")
        assert response.status_code == 503 and response.json()["status"] == "no_instances"

    async def test_no_conductor_is_503(self, http):
        error = error_of(await http.post(CHAT, json=chat()), 503)
        assert error["code"] == "unavailable" and error["type"] == "server_error"
