"""Decode instance: pulls a prefilled request's KV from the pool and transfer nodes, joins the
running batch, and streams tokens to the requester until a stop condition.

As it goes it stores the full blocks of generated tokens in the pool, so a migrated request
(and the next turn of a conversation) finds their KV there instead of recomputing it.
"""

from __future__ import annotations

import asyncio
import contextlib

from halfmoon.core.errors import EngineError
from halfmoon.engine.engine import RequestOutput
from halfmoon.protocol import codecs
from halfmoon.protocol.base import ErrorCode
from halfmoon.protocol.registry import Role
from halfmoon.protocol.work import DecodeRequest
from halfmoon.service.streaming import token_event
from halfmoon.service.worker import EngineWorker

STORE_EVERY_BLOCKS = 4  # store generated KV once this many new full blocks are computed


class DecodeService(EngineWorker):
    role = Role.DECODE
    submit_codec = codecs.DECODE_REQUEST

    @property
    def submit_subject(self) -> str:
        return self.subjects.decode_submit(self.instance_id)

    def accept(self, request: DecodeRequest):  # type: ignore[no-untyped-def, override]
        return self._serve(request)

    async def _serve(self, req: DecodeRequest) -> None:
        payloads = await self.handoff.receive(req.request_id, req.kv) if req.kv is not None else []
        try:
            await self._generate(req, payloads)
        except EngineError as exc:
            await self.send_error(req.stream_subject, req.request_id, ErrorCode.BAD_REQUEST, str(exc), req.attempt)

    async def _generate(self, req: DecodeRequest, payloads: list[memoryview]) -> None:
        assert self.engine is not None
        with self.tracer.start_as_current_span("decode.generate") as span:
            span.set_attribute("halfmoon.request_id", req.request_id)
            span.set_attribute("halfmoon.attempt", req.attempt)
            span.set_attribute("halfmoon.kv_recomputed", req.kv is None)
            produced = 0
            saver = _GeneratedKV(self, req)
            outputs = [*req.output_token_ids, req.first_token_id]
            try:
                async for out in self.engine.generate(req.request_id, req.prompt_token_ids, req.sampling,
                                                      output_token_ids=outputs, kv_blocks=payloads):
                    produced += len(out.new_token_ids)
                    await self.publish_event(req.stream_subject, token_event(out, req.sampling, self.instance_id,
                                                                             req.cached_tokens, req.attempt))
                    saver.progress(out)
            except asyncio.CancelledError:
                await saver.close(wait=False)
                await self.engine.abort(req.request_id)
                raise
            await saver.close(wait=True)
            span.set_attribute("halfmoon.tokens_generated", produced)


class _GeneratedKV:
    """Stores one request's newly computed full blocks in the pool, one store at a time, in the background."""

    def __init__(self, worker: DecodeService, req: DecodeRequest) -> None:
        self.worker, self.req = worker, req
        self.size = worker.config.block_size
        self.tokens = [*req.prompt_token_ids, *req.output_token_ids, req.first_token_id]
        self.stored = (len(req.prompt_token_ids) + len(req.output_token_ids)) // self.size  # prefill stored these
        self._task: asyncio.Task[None] | None = None

    def progress(self, out: RequestOutput) -> None:
        self.tokens.extend(out.new_token_ids)
        if out.finished:
            return  # the engine has freed its KV
        # The newest sampled token has no KV yet: everything before it is computed.
        computed_blocks = (len(self.tokens) - 1) // self.size
        if computed_blocks - self.stored >= STORE_EVERY_BLOCKS and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._store(self.stored, computed_blocks, list(self.tokens)))
            self.stored = computed_blocks

    async def _store(self, start: int, end: int, tokens: list[int]) -> None:
        worker, req = self.worker, self.req
        assert worker.engine is not None
        try:
            payloads = await worker.engine.call(lambda e: e.export_kv(req.request_id))
        except EngineError:
            return  # finished or preempted meanwhile: nothing to store now
        keys = worker.engine.kv_spec.hasher(req.tenant_salt).keys(tokens)
        end = min(end, len(keys), len(payloads))
        if end > start:
            await worker.pool.store(keys[start:end], payloads[start:end], first_position=start)

    async def close(self, wait: bool) -> None:
        """Let the store in flight finish (the request ended) or drop it (the request was cancelled)."""
        if self._task is None or self._task.done():
            return
        if not wait:
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
