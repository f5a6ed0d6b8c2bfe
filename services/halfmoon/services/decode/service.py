"""Decode instance: pulls a prefilled request's KV from the pool and transfer nodes, joins the
running batch, and streams tokens to the requester until a stop condition.

As it goes it stores the full blocks of generated tokens in the pool, so a migrated request
(and the next turn of a conversation) finds their KV there instead of recomputing it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from typing import Any

from halfmoon.core.errors import EngineError
from halfmoon.engine.interface import NO_KV, RequestKV
from halfmoon.protocol import codecs
from halfmoon.protocol.base import ErrorCode
from halfmoon.protocol.registry import Role
from halfmoon.protocol.work import DecodeRequest, KVProgress
from halfmoon.runtime.generated_kv import GeneratedKV
from halfmoon.runtime.layer_reader import LayerReader
from halfmoon.runtime.streaming import token_event
from halfmoon.runtime.worker import EngineWorker
from halfmoon.telemetry import extract_context


class DecodeService(EngineWorker):
    role = Role.DECODE
    submit_codec = codecs.DECODE_REQUEST

    @property
    def submit_subject(self) -> str:
        return self.subjects.decode_submit(self.instance_id)

    def issuer(self, request: DecodeRequest, subject: str) -> str:
        return request.gateway  # only prefill may submit here, and it is trusted with every stream

    def accept(self, request: DecodeRequest, gateway: str) -> Coroutine[Any, Any, None]:
        return self._serve(request, self.subjects.stream(gateway, request.request_id))

    async def start(self) -> None:
        await super().start()
        self.layers = LayerReader(self.transfer, self.pool.layout, self.tracer, self.log)
        await self.listen(self.subjects.decode_kv(self.instance_id), codecs.KV_PROGRESS, self._on_progress)

    async def _on_progress(self, msg: KVProgress, headers: Mapping[str, str]) -> None:
        await self.layers.on_progress(msg, extract_context(headers))

    async def _serve(self, req: DecodeRequest, stream: str) -> None:
        assert self.engine is not None
        streamed = await self.layers.take(req.request_id, req.layers_announced)
        # An engine that moves its own KV (pool_kv) reads the prompt's blocks from the pool by their keys;
        # the one-off blocks a hand-off may point at (the partial last one) are dropped unread.
        pooled = req.kv is None or self.engine.pool_kv
        payloads = [] if pooled or req.kv is None else await self.handoff.receive(req.request_id, req.kv, streamed)
        # the one-off blocks are read: dropping them need not hold up the first step
        dropping = asyncio.create_task(self.handoff.drop(req.request_id, req.kv)) if req.kv is not None else None
        try:
            await self._generate(req, stream, payloads)
        except EngineError as exc:
            await self.send_error(stream, req.request_id, ErrorCode.BAD_REQUEST, str(exc), req.attempt)
        finally:
            if dropping is not None:
                await dropping

    async def _generate(self, req: DecodeRequest, stream: str, payloads: list[memoryview]) -> None:
        assert self.engine is not None
        with self.tracer.start_as_current_span("decode.generate") as span:
            span.set_attribute("halfmoon.request_id", req.request_id)
            span.set_attribute("halfmoon.attempt", req.attempt)
            span.set_attribute("halfmoon.kv_recomputed", req.kv is None)
            produced = 0
            outputs = [*req.output_token_ids, req.first_token_id]
            context = [*req.prompt_token_ids, *outputs]
            pooled = self.engine.pool_kv  # the engine reads and stores the pool's blocks itself, by these keys
            keys = self.engine.kv_spec.hasher(req.tenant_salt).keys(context) if pooled else []
            saver = None if pooled else GeneratedKV(self, req.request_id, req.tenant_salt, context,
                                                    # prefill stored the blocks before the first token
                                                    (len(context) - 1) // self.config.block_size)
            try:
                async for out in self.engine.generate(req.request_id, req.prompt_token_ids, req.sampling,
                                                      output_token_ids=outputs, block_keys=keys,
                                                      tenant_salt=req.tenant_salt,
                                                      kv=NO_KV if pooled else RequestKV(source=payloads)):
                    produced += len(out.new_token_ids)
                    await self.publish_event(stream, token_event(out, req.sampling, self.instance_id,
                                                                 req.cached_tokens, req.attempt))
                    if saver is not None:
                        saver.progress(out)
            except asyncio.CancelledError:
                if saver is not None:
                    await saver.close(wait=False)
                await self.engine.abort(req.request_id)
                raise
            if saver is not None:
                await saver.close(wait=True)
            span.set_attribute("halfmoon.tokens_generated", produced)
