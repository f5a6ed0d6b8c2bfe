"""Aggregated instance: prefills and decodes each request in its own engine, with no hand-off.

It takes PrefillRequests like a prefill instance (the conductor places both phases here), reuses the
prompt's prefix from its local cache and the KVCache pool, and, like a decode instance, stores the
blocks it computes (the prompt's at once, generated ones as they fill) in the pool for the others.
"""

from __future__ import annotations

import asyncio
import time

from halfmoon.core.errors import EngineError
from halfmoon.protocol.base import ErrorCode
from halfmoon.protocol.registry import Role
from halfmoon.protocol.work import PrefillRequest
from halfmoon.runtime.generated_kv import GeneratedKV
from halfmoon.runtime.streaming import token_event
from halfmoon.services.prefill.service import Prefix, PrefillService


class AggregatedService(PrefillService):
    role = Role.AGGREGATED

    async def _serve(self, req: PrefillRequest) -> None:
        started = time.perf_counter()
        prefix = await self.fetch_prefix(req)
        try:
            await self._generate(req, prefix, started)
        except EngineError as exc:
            await self.send_error(self.stream_of(req), req.request_id, ErrorCode.BAD_REQUEST, str(exc), req.attempt)
        finally:
            await self.pool.release(prefix.fetched.lease_id)

    async def _generate(self, req: PrefillRequest, prefix: Prefix, started: float) -> None:
        assert self.engine is not None
        context = len(req.prompt_token_ids) + len(req.output_token_ids)
        reused = prefix.local + len(prefix.fetched.payloads)
        saver = GeneratedKV(self, req.request_id, req.tenant_salt, [*req.prompt_token_ids, *req.output_token_ids],
                            reused)
        cached: int | None = None
        with self.tracer.start_as_current_span("aggregated.generate") as span:
            span.set_attribute("halfmoon.request_id", req.request_id)
            span.set_attribute("halfmoon.prompt_tokens", len(req.prompt_token_ids))
            span.set_attribute("halfmoon.blocks_hit", prefix.local + len(prefix.fetched.payloads))
            try:
                async for out in self.engine.generate(req.request_id, req.prompt_token_ids, req.sampling,
                                                      output_token_ids=req.output_token_ids,
                                                      kv_blocks=[] if prefix.fetched.layers else prefix.fetched.payloads,
                                                      kv_layers=prefix.fetched.layers, kv_start_block=prefix.local,
                                                      block_keys=self.prompt_keys(req, prefix.keys),
                                                      # taken on the engine thread: a short answer may end, and
                                                      # its KV be freed, before a later export could run
                                                      export_prompt_from=reused):
                    first = cached is None
                    if cached is None:
                        cached = out.num_cached_tokens
                        self.record_ttft(time.perf_counter() - started)
                    # the prompt's blocks (out.prompt_kv) go to the pool at once; generated ones in batches
                    saver.progress(out)
                    await self.publish_event(self.stream_of(req), token_event(out, req.sampling, self.instance_id,
                                                                             cached, req.attempt))
                    if first:
                        self.report_prefilled(req.request_id)
                        await self.publish_cache_events((context - cached, cached, out.compute_s))
            except asyncio.CancelledError:
                await saver.close(wait=False)
                await self.engine.abort(req.request_id)
                raise
            await saver.close(wait=True)
            span.set_attribute("halfmoon.tokens_computed", context - (cached or 0))
