"""The published API contract (``/openapi.json``), built from the structs the gateway decodes
requests with and from structs of the bodies ``responses.py`` writes; the schemathesis test in
tests/security/ holds every live response to it."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from halfmoon.protocol.sampling import MAX_TOP_K, SEED_RANGE
from halfmoon.services.gateway.schemas import ChatCompletionRequest, CompletionRequest


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class UsageBody(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: None
    text_offset: None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageBody


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[Any]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]
    refusal: None


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None
    refusal: None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageBody


class ModelCard(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorDetail


class Health(msgspec.Struct):
    status: Literal["ok", "draining"]


_TYPES = (CompletionRequest, ChatCompletionRequest, Completion, ChatCompletion, ModelList, ErrorResponse, Health)
_ERRORS = {
    "400": "invalid request (body, parameters or prompt length)",
    "401": "missing or unknown API key",
    "404": "unknown model",
    "413": "request body too large",
    "429": "rate limited or overloaded (see Retry-After)",
    "503": "no instance can serve it, or this gateway is draining",
    "504": "the serving path timed out",
}


# The ranges ``schemas.py`` checks after decoding (``check()``), published so clients and fuzzers see them.
_NON_EMPTY = {"type": "string", "minLength": 1}
_COMMON_RANGES: dict[str, dict[str, Any]] = {
    "max_tokens": {"minimum": 1},
    "temperature": {"minimum": 0, "maximum": 2},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": 0, "maximum": MAX_TOP_K},
    "seed": {"minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1]},
    "n": {"minimum": 1, "maximum": 1},
    "presence_penalty": {"minimum": 0, "maximum": 0},
    "frequency_penalty": {"minimum": 0, "maximum": 0},
    "stop": {"anyOf": [_NON_EMPTY, {"type": "array", "items": _NON_EMPTY, "maxItems": 16}, {"type": "null"}]},
}
_RANGES: dict[str, dict[str, dict[str, Any]]] = {
    "CompletionRequest": {**_COMMON_RANGES, "logprobs": {"minimum": 0, "maximum": 0}, "echo": {"const": False}},
    "ChatCompletionRequest": {**_COMMON_RANGES, "messages": {"minItems": 1}, "max_completion_tokens": {"minimum": 1},
                              "top_logprobs": {"minimum": 0, "maximum": 0}},
}


def _request_schema(schema: dict[str, Any], name: str, model: str) -> None:
    properties = schema["properties"]
    properties["model"] = {"type": "string", "enum": [model]}
    for field, ranges in _RANGES[name].items():
        if "anyOf" in ranges:
            properties[field] = {k: v for k, v in properties[field].items() if k not in ("anyOf", "type")}
        properties[field].update(ranges)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(name)}}


def _errors(*statuses: str) -> dict[str, Any]:
    return {s: {"description": _ERRORS[s], "content": _json("ErrorResponse")} for s in statuses}


def _generation(request: str, response: str, summary: str, secured: list) -> dict[str, Any]:
    event = {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "description": "one JSON chunk, an error body, or [DONE] at the end"}}}
    sse = {"text/event-stream": {"schema": event}}  # each server-sent event
    return {"post": {
        "summary": summary,
        "security": secured,
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {"description": "the whole response, or server-sent events when stream is true",
                    "content": {**_json(response), **sse}},
            **_errors("400", "401", "404", "413", "429", "503", "504"),
        },
    }}


def openapi_document(authenticated: bool, model: str) -> dict[str, Any]:
    """OpenAPI 3.1 for the routes this gateway serves; with keys, /v1 routes need a bearer key.
    ``model`` is the one model it serves (any other name is a documented 404)."""
    _, components = msgspec.json.schema_components(_TYPES, ref_template="#/components/schemas/{name}")
    for request in _RANGES:
        _request_schema(components[request], request, model)
    secured: list[dict[str, list[str]]] = [{"bearerAuth": []}] if authenticated else []
    return {
        "openapi": "3.1.0",
        "info": {"title": "Halfmoon gateway (OpenAI-compatible)", "version": "1"},
        "components": {"schemas": components,
                       "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/completions": _generation("CompletionRequest", "Completion", "text completion", secured),
            "/v1/chat/completions": _generation("ChatCompletionRequest", "ChatCompletion", "chat completion",
                                                secured),
            "/v1/models": {"get": {"summary": "the served model", "security": secured, "responses": {
                "200": {"description": "the model list", "content": _json("ModelList")}, **_errors("401")}}},
            "/health": {"get": {"summary": "liveness; 503 while draining", "responses": {
                "200": {"description": "serving", "content": _json("Health")},
                "503": {"description": "draining", "content": _json("Health")}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (unauthenticated, like /health)", "responses": {
                "200": {"description": "text exposition format", "content": {"text/plain": {
                    "schema": {"type": "string"}}}}}}},
        },
    }
