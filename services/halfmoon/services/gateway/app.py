"""The HTTP surface: OpenAI-compatible routes over a ServingClient."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from halfmoon.core.detokenizer import IncrementalDetokenizer
from halfmoon.protocol.stream import TokenEvent, Usage
from halfmoon.services.gateway.client import Generation, GenerationError, ServingClient
from halfmoon.services.gateway.errors import ApiError, from_backend, from_validation, invalid
from halfmoon.services.gateway.guard import Guard
from halfmoon.services.gateway.guards import check_nesting, check_wire_size
from halfmoon.services.gateway.http_limits import BodyIdle
from halfmoon.services.gateway.metrics import GatewayMetrics
from halfmoon.services.gateway.model import ServedModel
from halfmoon.services.gateway.openapi import openapi_document
from halfmoon.services.gateway.peers import readiness
from halfmoon.services.gateway.responses import Kind, LogprobAccumulator, ResponseShape
from halfmoon.services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from halfmoon.telemetry import extract_context
from halfmoon.telemetry.metrics import METRICS

log = logging.getLogger("halfmoon.gateway")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default; chat defaults to the rest of the context


@dataclass(frozen=True)
class ApiLimits:
    max_body_bytes: int


class _Output:
    """Accumulates one response's text, logprobs and usage from TokenEvents."""

    def __init__(self, model: ServedModel, kind: Kind, prompt_len: int, logprobs: bool) -> None:
        self._model = model
        self._detok = IncrementalDetokenizer(model.tokenizer)
        self.logprobs = LogprobAccumulator(kind) if logprobs else None
        self.text: list[str] = []
        self.finish: str | None = None
        self.usage = Usage(prompt_tokens=prompt_len, completion_tokens=0)

    def add(self, event: TokenEvent) -> tuple[str, dict | None]:
        """The event's text delta and logprobs body (engine text wins over local detokenising)."""
        delta = event.text if event.text is not None else self._detok.push(event.token_ids).text
        if event.finish_reason is not None:
            if event.text is None:
                delta += self._detok.flush()
            assert event.usage is not None  # it comes with finish_reason (TokenEvent checks)
            self.finish, self.usage = event.finish_reason, event.usage
        self.text.append(delta)
        lp = None
        if self.logprobs is not None and event.logprobs is not None:
            lp = self.logprobs.add([self._model.token_text(t) for t in event.token_ids], event.logprobs)
        return delta, lp


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class GatewayApi:
    """Validation, tokenisation and response shaping; generation itself is the client's."""

    def __init__(
        self,
        model: ServedModel,
        client: ServingClient,
        limits: ApiLimits,
        metrics: GatewayMetrics,
        tracer: trace.Tracer,
        accepting: Callable[[], bool],
        guard: Guard,
    ) -> None:
        self.model, self.client, self.limits = model, client, limits
        self.metrics, self.tracer, self.accepting, self.guard = metrics, tracer, accepting, guard

    def build(self) -> FastAPI:
        app = FastAPI(title="halfmoon gateway", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/ready", self.ready, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus, methods=["GET"])
        document = openapi_document(self.guard.keys is not None, self.model.name)
        app.add_api_route("/openapi.json", lambda: JSONResponse(document), methods=["GET"])
        app.add_exception_handler(ApiError, self._api_error)  # type: ignore[arg-type]  # starlette calls it with ApiErrors only
        app.add_exception_handler(StarletteHTTPException, self._http_error)  # type: ignore[arg-type]  # called with HTTPExceptions only
        app.add_exception_handler(Exception, self._unexpected)
        return app

    async def _api_error(self, _request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(f"req-{uuid.uuid4().hex}")

    async def _http_error(self, _request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return error.response(f"req-{uuid.uuid4().hex}")

    async def _unexpected(self, _request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return ApiError(500, "internal error", code="internal").response(f"req-{uuid.uuid4().hex}")

    async def models(self, request: Request) -> dict[str, Any]:
        self.guard.authenticate(request.headers)
        card = {
            "id": self.model.name,
            "object": "model",
            "created": 0,
            "owned_by": "halfmoon",
            "max_model_len": self.model.context_len,
        }
        return {"object": "list", "data": [card]}

    async def health(self) -> JSONResponse:
        if not self.accepting():
            return JSONResponse({"status": "draining"}, status_code=503)
        ok, reason = self.client.service.liveness.status()
        if not ok:
            return JSONResponse({"status": "nats_unreachable", "detail": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def ready(self) -> JSONResponse:
        """Readiness, apart from liveness (``/health``): 200 once a conductor that takes schedule requests
        knows a live prefill and decode instance, or an aggregated one, so a request sent now is placed."""
        live = await self.health()
        if live.status_code != 200:
            return live
        answer = await readiness(self.client.service)
        if isinstance(answer, str):
            return JSONResponse({"status": "no_conductor", "detail": answer}, status_code=503)
        body = {"status": "ready" if answer.ready else "no_instances", "conductor": answer.conductor,
                "prefill": answer.prefill, "decode": answer.decode, "aggregated": answer.aggregated}
        return JSONResponse(body, status_code=200 if answer.ready else 503)

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completion", "/v1/completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat", "/v1/chat/completions")

    async def _serve(self, request: Request, kind: Kind, endpoint: str) -> Response:
        request_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        # a client that sends traceparent gets the whole serving path inside its own trace
        span = self.tracer.start_span(
            f"gateway {endpoint}",
            context=extract_context(request.headers),
            kind=SpanKind.SERVER,
            attributes={"halfmoon.request_id": request_id},
        )
        try:
            with trace.use_span(span, end_on_exit=False):
                response = await self._generate(request, kind, request_id, span)
        except ApiError as exc:
            span.set_status(Status(StatusCode.ERROR, exc.message))
            if span.is_recording():
                span.end()
            self.metrics.requests.labels(endpoint, str(exc.status)).inc()
            if exc.status >= 500:
                METRICS.errors.labels(exc.code or "internal").inc()
            return exc.response(request_id)
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    async def _read_body(self, request: Request) -> bytes:
        limit = self.limits.max_body_bytes
        too_big = ApiError(413, f"Request body exceeds the {limit}-byte limit.", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
        except BodyIdle as exc:  # a slow body would hold its connection for as long as the client likes
            raise ApiError(408, f"Request body stalled: {exc}.", code="request_timeout",
                           headers={"connection": "close"}) from None
        return b"".join(chunks)

    async def _parse(self, request: Request, kind: Kind) -> CompletionRequest | ChatCompletionRequest:
        body = await self._read_body(request)
        check_nesting(body)  # before any decoder recurses into it
        schema: type[CompletionRequest] | type[ChatCompletionRequest] = (
            CompletionRequest if kind == "completion" else ChatCompletionRequest)
        try:
            parsed: CompletionRequest | ChatCompletionRequest = msgspec.json.decode(body, type=schema)
        except msgspec.ValidationError as exc:
            raise from_validation(exc) from None
        except msgspec.DecodeError as exc:
            raise invalid(f"Request body is not valid JSON: {exc}.", code="invalid_json") from None
        parsed.check()
        if parsed.model != self.model.name:
            raise ApiError(
                404,
                f"The model '{parsed.model}' does not exist; this server serves '{self.model.name}'.",
                param="model",
                code="model_not_found",
            )
        return parsed

    async def _prompt_ids(self, parsed: CompletionRequest | ChatCompletionRequest) -> list[int]:
        if isinstance(parsed, ChatCompletionRequest):
            return await asyncio.to_thread(self.model.encode_chat, parsed.messages)
        prompt = parsed.single_prompt()
        if isinstance(prompt, str):
            return await asyncio.to_thread(self.model.encode_text, prompt)
        self.model.check_ids(prompt)
        return list(prompt)

    async def _generate(self, request: Request, kind: Kind, request_id: str, span: Span) -> Response:
        tenant = self.guard.authenticate(request.headers)
        if not self.accepting():
            raise ApiError(503, "The gateway is shutting down; retry on another replica.", code="unavailable")
        parsed = await self._parse(request, kind)
        prompt_ids = await self._prompt_ids(parsed)
        if isinstance(parsed, ChatCompletionRequest):
            budget = self.model.output_budget(len(prompt_ids), parsed.token_limit, None, "messages")
        else:
            budget = self.model.output_budget(
                len(prompt_ids), parsed.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt"
            )
        try:
            sampling = parsed.sampling(budget, parsed.wants_logprobs)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        self.model.check_ids(parsed.stop_token_ids, param="stop_token_ids")
        check_wire_size(prompt_ids, sampling, self.client.service.nc.max_payload)
        await self.guard.admit(tenant, len(prompt_ids) + budget)
        span.set_attribute("halfmoon.prompt_tokens", len(prompt_ids))
        shape = ResponseShape(kind, request_id, self.model.name)
        output = _Output(self.model, kind, len(prompt_ids), parsed.wants_logprobs)
        salt = self.guard.cache_salt(tenant, parsed.cache_salt)
        gen = self.client.generation(request_id, prompt_ids, sampling, tenant_salt=salt, span=span,
                                     tenant=tenant.name if tenant is not None else "")
        started = time.monotonic()
        try:
            await gen.__aenter__()
        except GenerationError as exc:
            raise from_backend(exc.code, exc.message, exc.retry_after_s) from None
        self.metrics.in_flight.inc()
        events = gen.events()
        closer = _Closer(gen, span, self.metrics)
        try:
            first = await anext(events)
        except GenerationError as exc:
            await closer.close()
            raise from_backend(exc.code, exc.message, exc.retry_after_s) from None
        self.metrics.ttft.observe(time.monotonic() - started)
        headers = {"x-request-id": request_id}
        if parsed.stream:
            body = self._stream(shape, output, first, events, parsed.include_usage, closer)
            return StreamingResponse(
                body, media_type="text/event-stream", headers=headers, background=BackgroundTask(closer.close)
            )
        try:
            output.add(first)
            async for event in self._timed(events):
                output.add(event)
        except GenerationError as exc:
            raise from_backend(exc.code, exc.message, exc.retry_after_s) from None
        finally:
            await closer.close()
        self._count(output.usage)
        logprobs = output.logprobs.body() if output.logprobs is not None else None
        return JSONResponse(shape.full("".join(output.text), output.finish, output.usage, logprobs), headers=headers)

    async def _timed(self, events: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
        last = time.monotonic()
        async for event in events:
            now = time.monotonic()
            self.metrics.itl.observe(now - last)
            last = now
            yield event

    def _count(self, usage: Usage) -> None:
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        self.metrics.cached_tokens.inc(usage.cached_tokens)
        self.metrics.completion_tokens.inc(usage.completion_tokens)

    async def _stream(
        self,
        shape: ResponseShape,
        output: _Output,
        first: TokenEvent,
        events: AsyncIterator[TokenEvent],
        include_usage: bool,
        closer: _Closer,
    ) -> AsyncIterator[bytes]:
        try:
            if shape.kind == "chat":
                yield _sse(shape.chunk("", None, None, first=True))
            pending: list[TokenEvent] = [first]
            async for event in self._chain(pending, self._timed(events)):
                delta, lp = output.add(event)
                if delta or lp is not None or event.finish_reason is not None:
                    yield _sse(shape.chunk(delta, event.finish_reason, lp))
            self._count(output.usage)
            if include_usage:
                yield _sse(shape.usage_chunk(output.usage))
            yield b"data: [DONE]\n\n"
        except GenerationError as exc:
            closer.span.set_status(Status(StatusCode.ERROR, exc.message))
            yield _sse(from_backend(exc.code, exc.message).body())
        finally:
            await closer.close()

    @staticmethod
    async def _chain(head: list[TokenEvent], rest: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
        for event in head:
            yield event
        async for event in rest:
            yield event


class _Closer:
    """Ends a generation exactly once, whichever of the stream, the error path or the
    response's background task gets there first (a client can vanish before streaming starts)."""

    def __init__(self, gen: Generation, span: Span, metrics: GatewayMetrics) -> None:
        self.gen, self.span, self.metrics = gen, span, metrics
        self._closed = False

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.metrics.in_flight.dec()
        await self.gen.__aexit__(None, None, None)
        self.span.end()
