"""A small, real OpenAI-compatible server for driving `halfmoon bench`: uvicorn on a free loopback port,
streaming completions as SSE with a known timing, a prefix cache of 4-token blocks, and known failures."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from halfmoon.deploy.processes import free_port

CACHE_BLOCK = 4


@dataclass
class Seen:
    body: dict[str, Any]
    received_at: float  # time.monotonic()


@dataclass
class StubServer:
    """Every ``fail_every``-th request (counting from 1) is answered 429; a request whose ``max_tokens`` is
    ``stream_error_at`` fails inside its stream after its first token. The first token comes ``first_s``
    after the request, every next one ``token_s`` after the previous. ``retry_after``: the 429s' header."""

    first_s: float = 0.05
    token_s: float = 0.02
    fail_every: int = 0
    stream_error_at: int = -1
    retry_after: str | None = None
    seen: list[Seen] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0
    _blocks: set[tuple[int, ...]] = field(default_factory=set)

    def cached_tokens(self, prompt: list[int]) -> int:
        """Prompt tokens in whole blocks already seen as a prefix (then remember this prompt's blocks)."""
        hit, reusing = 0, True
        for end in range(CACHE_BLOCK, len(prompt) + 1, CACHE_BLOCK):
            prefix = tuple(prompt[:end])
            reusing = reusing and prefix in self._blocks
            hit += CACHE_BLOCK if reusing else 0
            self._blocks.add(prefix)
        return hit

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await request.json()
            self.seen.append(Seen(body, time.monotonic()))
            if self.fail_every and len(self.seen) % self.fail_every == 0:
                error = {"message": "too many requests", "type": "rate_limit", "code": "overloaded"}
                headers = {"retry-after": self.retry_after} if self.retry_after else None
                return JSONResponse({"error": error}, status_code=429, headers=headers)
            return StreamingResponse(self._stream(body), media_type="text/event-stream")

        return app

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            cached = self.cached_tokens(body["prompt"])
            n = body["max_tokens"]
            await asyncio.sleep(self.first_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(self.token_s)
                chunk = {"id": "cmpl-stub", "object": "text_completion",
                         "choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                if n == self.stream_error_at:
                    yield b'data: {"error": {"message": "engine failed", "code": "internal"}}\n\n'
                    return
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": len(body["prompt"]) + n,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            yield f"data: {json.dumps({'id': 'cmpl-stub', 'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


class Serving:
    """Runs a StubServer's app with uvicorn on a thread until ``stop``."""

    def __init__(self, stub: StubServer) -> None:
        self.stub = stub
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(stub.app(), host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> Serving:
        self.thread.start()
        end = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > end or not self.thread.is_alive():
                raise RuntimeError("the stub OpenAI server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
