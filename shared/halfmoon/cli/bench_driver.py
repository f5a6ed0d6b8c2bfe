"""The load driver of `halfmoon bench`: streaming completions against any OpenAI-compatible endpoint.

Each request is one ``POST {base_url}/completions`` with ``stream: true`` and usage in the last chunk;
the driver stamps the arrival of every streamed chunk (one token per chunk on the servers we drive;
``usage.completion_tokens`` gives the true count). A fixed-concurrency run keeps ``concurrency``
requests in flight; a trace run starts each request at its arrival time (at most ``concurrency`` in
flight when it is not 0). In a fixed-concurrency run a slot answered 429 with ``Retry-After`` waits that
long (at most ``Endpoint.max_backoff_s``) before its next request, as a well-behaved client does, so a
server that rejects fast does not burn through the run's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import httpx

from halfmoon.cli.bench_workload import BenchRequest


class Endpoint(NamedTuple):
    base_url: str  # the API root, as OpenAI clients take it: http://127.0.0.1:8000/v1
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    timeout_s: float = 600.0
    max_backoff_s: float = 30.0  # the longest a fixed-concurrency slot honours a 429's Retry-After

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestResult:
    """What one request did, in seconds from the start of the run."""

    sent_at: float
    prompt_tokens: int
    status: str = "200"  # HTTP status, "stream" (an error inside the stream) or the exception's name
    error: str = ""
    token_times: list[float] = field(default_factory=list)  # arrival of each streamed chunk
    output_tokens: int = 0
    cached_tokens: int | None = None
    finished_at: float = 0.0
    retry_after_s: float | None = None  # a rejection's Retry-After (delta-seconds)

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (0 for single-token outputs)."""
        if not self.token_times:
            return None
        return (self.token_times[-1] - self.token_times[0]) / max(1, self.output_tokens - 1)


class RunResult(NamedTuple):
    results: list[RequestResult]
    duration_s: float


def request_body(endpoint: Endpoint, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": endpoint.model, "prompt": req.prompt, "max_tokens": req.max_tokens,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.ignore_eos:
        body["ignore_eos"] = True
    return body


def _apply_chunk(result: RequestResult, chunk: dict[str, Any], now: float) -> None:
    if "error" in chunk:
        error = chunk["error"]
        result.status, result.error = "stream", str(error.get("message", error) if isinstance(error, dict) else error)
        return
    if chunk.get("choices"):
        result.token_times.append(now)
    usage = chunk.get("usage")
    if usage:
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            result.cached_tokens = int(details["cached_tokens"])


def _seconds(header: str | None) -> float | None:
    """A Retry-After in delta-seconds (the HTTP-date form is not used by the servers we drive)."""
    try:
        value = float(header or "nan")
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


async def send(client: httpx.AsyncClient, endpoint: Endpoint, req: BenchRequest, t0: float) -> RequestResult:
    result = RequestResult(time.perf_counter() - t0, len(req.prompt))
    try:
        async with client.stream("POST", f"{endpoint.base_url.rstrip('/')}/completions",
                                 json=request_body(endpoint, req), headers=endpoint.headers()) as reply:
            if reply.status_code != 200:
                body = (await reply.aread()).decode(errors="replace")
                result.status, result.error = str(reply.status_code), body[:500] or reply.reason_phrase
                result.retry_after_s = _seconds(reply.headers.get("retry-after"))
            else:
                async for line in reply.aiter_lines():
                    if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                        continue
                    _apply_chunk(result, json.loads(data), time.perf_counter() - t0)
                    if result.error:
                        break
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.status, result.error = type(exc).__name__, str(exc) or type(exc).__name__
    if result.ok and not result.token_times:
        result.status, result.error = "empty", "the stream ended without a token"
    if result.ok and not result.output_tokens:  # a server that sends no usage: one token per chunk
        result.output_tokens = len(result.token_times)
    result.finished_at = time.perf_counter() - t0
    return result


async def run(endpoint: Endpoint, requests: Sequence[BenchRequest], concurrency: int,
              on_done: Callable[[RequestResult], None] = lambda _r: None, paced: bool = False) -> RunResult:
    """Send ``requests``; ``paced``: each at its ``arrival_s`` (``concurrency`` 0: no limit), otherwise
    ``concurrency`` at a time back to back. Results come back in the order of ``requests``."""
    if concurrency < 0 or (concurrency == 0 and not paced):
        raise ValueError("concurrency must be >= 1 (or 0 for an unbounded paced run)")
    limits = httpx.Limits(max_connections=concurrency or None, max_keepalive_connections=concurrency or None)
    results: list[RequestResult | None] = [None] * len(requests)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(endpoint.timeout_s, connect=30.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            if paced:
                await asyncio.sleep(max(0.0, requests[i].arrival_s - (time.perf_counter() - t0)))
            async with gate or contextlib.nullcontext():
                results[i] = result = await send(client, endpoint, requests[i], t0)
                on_done(result)
                if not paced and result.retry_after_s:  # the slot waits, holding its place in the gate
                    await asyncio.sleep(min(result.retry_after_s, endpoint.max_backoff_s))

        await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - t0
    return RunResult([r for r in results if r is not None], duration)
