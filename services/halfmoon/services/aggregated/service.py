"""Aggregated instance: prefills and decodes each request in its own engine, with no hand-off.

It takes PrefillRequests like a prefill instance (the conductor places both phases here) and is built
from the same parts as the two: a prefill's prefix reuse (its local cache, then the KVCache pool, and
the conductor told what the local cache holds) and a decode's store of the blocks it computes (the
prompt's at once, generated ones as they fill) in the pool for the others.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

from opentelemetry.trace import TracerProvider

from halfmoon.core.errors import EngineError
from halfmoon.engine.interface import NO_KV
from halfmoon.protocol import codecs
from halfmoon.protocol.base import ErrorCode
from halfmoon.protocol.registry import Role
from halfmoon.protocol.subjects import Subjects
from halfmoon.protocol.work import PrefillRequest
from halfmoon.runtime.generated_kv import GeneratedKV
from halfmoon.runtime.prefix_reuse import Prefix, PrefixReuse
from halfmoon.runtime.streaming import token_event
from halfmoon.runtime.worker import EngineWorker, WorkerConfig


class AggregatedService(EngineWorker):
    role = Role.AGGREGATED
    submit_codec = codecs.PREFILL_REQUEST

    def __init__(self, config: WorkerConfig, tracer_provider: TracerProvider | None = None) -> None:
        super().__init__(config, tracer_provider)
        self.prefix = PrefixReuse(self)

    @property
    def submit_subject(self) -> str:
        return self.subjects.prefill_submit_to(self.instance_id)

    def issuer(self, request: PrefillRequest, subject: str) -> str:
        return Subjects.submitter(subject)  # each gateway's NATS user may submit only naming itself

    def accept(self, request: PrefillRequest, gateway: str) -> Coroutine[Any, Any, None]:
        return self._serve(request, self.subjects.stream(gateway, request.request_id))

    async def start(self) -> None:
        await super().start()
        await self.prefix.start()

    async def _serve(self, req: PrefillRequest, stream: str) -> None:
        started = time.perf_counter()
        prefix = await self.prefix.fetch(req)
        try:
            await self._generate(req, stream, prefix, started)
        except EngineError as exc:
            await self.send_error(stream, req.request_id, ErrorCode.BAD_REQUEST, str(exc), req.attempt)
        finally:
            await self.pool.release(prefix.fetched.lease_id)

    async def _generate(self, req: PrefillRequest, stream: str, prefix: Prefix, started: float) -> None:
        assert self.engine is not None
        context = len(req.prompt_token_ids) + len(req.output_token_ids)
        pooled = self.engine.pool_kv  # the engine stores what it computes in the pool itself
        saver = None if pooled else GeneratedKV(self, req.request_id, req.tenant_salt,
                                                [*req.prompt_token_ids, *req.output_token_ids], prefix.reused)
        cached: int | None = None
        with self.tracer.start_as_current_span("aggregated.generate") as span:
            span.set_attribute("halfmoon.request_id", req.request_id)
            span.set_attribute("halfmoon.prompt_tokens", len(req.prompt_token_ids))
            span.set_attribute("halfmoon.blocks_hit", prefix.reused)
            try:
                async for out in self.engine.generate(req.request_id, req.prompt_token_ids, req.sampling,
                                                      output_token_ids=req.output_token_ids,
                                                      block_keys=self.prefix.prompt_keys(req, prefix.keys),
                                                      tenant_salt=req.tenant_salt,
                                                      step_target_s=req.step_target_s,
                                                      # taken on the engine thread: a short answer may end, and
                                                      # its KV be freed, before a later export could run
                                                      kv=NO_KV if pooled else prefix.kv(export_prompt_from=prefix.reused)):
                    first = cached is None
                    if cached is None:
                        cached = out.num_cached_tokens
                        self.record_ttft(time.perf_counter() - started)
                    # the prompt's blocks (out.prompt_kv) go to the pool at once; generated ones in batches
                    if saver is not None:
                        saver.progress(out)
                    await self.publish_event(stream, token_event(out, req.sampling, self.instance_id, cached,
                                                                 req.attempt))
                    if first:
                        self.report_prefilled(req.request_id)
                        await self.prefix.publish_cache_events((context - cached, cached, out.compute_s))
            except asyncio.CancelledError:
                if saver is not None:
                    await saver.close(wait=False)
                await self.engine.abort(req.request_id)
                raise
            if saver is not None:
                await saver.close(wait=True)
            span.set_attribute("halfmoon.tokens_computed", context - (cached or 0))
