"""Prefill instance: reuses the prompt's cached prefix from the pool, computes the rest, stores the
new full blocks back, and hands the request to the decode instance the conductor chose."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from halfmoon.core.errors import EngineError
from halfmoon.engine.engine import PREFILL_DONE, RequestOutput
from halfmoon.protocol import codecs
from halfmoon.protocol.base import ErrorCode, RemoteError
from halfmoon.protocol.pool import KVEvents, SnapshotRequest
from halfmoon.protocol.registry import Role
from halfmoon.protocol.work import DecodeRequest, PrefillRequest
from halfmoon.service.pool_client import Fetched
from halfmoon.service.streaming import token_event
from halfmoon.service.worker import EngineWorker
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.transport import TransferError

HANDOFF_TIMEOUT_S = 10.0


class PrefillService(EngineWorker):
    role = Role.PREFILL
    submit_codec = codecs.PREFILL_REQUEST

    @property
    def submit_subject(self) -> str:
        return self.subjects.prefill_submit(self.instance_id)

    def accept(self, request: PrefillRequest):  # type: ignore[no-untyped-def, override]
        return self._serve(request)

    @property
    def local_cache(self) -> bool:
        return self.config.local_prefix_cache

    def block_keys(self, req: PrefillRequest) -> list[bytes]:
        assert self.engine is not None
        return self.engine.kv_spec.hasher(req.tenant_salt).keys(req.prompt_token_ids)

    async def _serve(self, req: PrefillRequest) -> None:
        started = time.perf_counter()
        keys = self.block_keys(req)
        # The last prompt token is always computed: its logits give the first output token.
        reusable = keys[: (len(req.prompt_token_ids) - 1) // self.config.block_size]
        # Local prefix cache first; the pool supplies what follows it.
        local = await self.engine.call(lambda e: e.cached_prefix_blocks(reusable)) if self.local_cache else 0
        fetched = await self.pool.fetch_prefix(reusable[local:])
        METRICS.cache_hit_blocks.labels(self.role.value).inc(local + len(fetched.payloads))
        METRICS.cache_miss_blocks.labels(self.role.value).inc(len(reusable) - local - len(fetched.payloads))
        try:
            try:
                computing = time.perf_counter()
                first = await self._compute(req, keys, local, fetched.payloads)
            except EngineError as exc:
                await self.send_error(req.stream_subject, req.request_id, ErrorCode.BAD_REQUEST, str(exc))
                return
            finished = time.perf_counter()
            self.done_computing(req.request_id)
            await self.publish(req.stream_subject, token_event(first, req.sampling, self.instance_id,
                                                               first.num_cached_tokens))
            self.meter.ttft_ms.append((finished - started) * 1000)
            METRICS.ttft.labels(self.instance_id).observe(finished - started)
            cached = first.num_cached_tokens
            await self._publish_cache_events((len(req.prompt_token_ids) - cached, cached, finished - computing))
            if first.finish_reason == PREFILL_DONE:
                await self._hand_off(req, first, keys, local, fetched)
        except (RemoteError, TransferError, OSError, EngineError) as exc:
            code = exc.code if isinstance(exc, RemoteError) else ErrorCode.UNAVAILABLE
            await self.send_error(req.stream_subject, req.request_id, code, f"hand-off to decode failed: {exc}")
        finally:
            await self.pool.release(fetched.lease_id)

    async def _compute(self, req: PrefillRequest, keys: list[bytes], local: int,
                       pooled: list[memoryview]) -> RequestOutput:
        assert self.engine is not None
        with self.tracer.start_as_current_span("prefill.compute") as span:
            span.set_attribute("halfmoon.request_id", req.request_id)
            span.set_attribute("halfmoon.prompt_tokens", len(req.prompt_token_ids))
            span.set_attribute("halfmoon.blocks_hit_local", local)
            span.set_attribute("halfmoon.blocks_hit", local + len(pooled))
            outputs = []
            try:
                async for out in self.engine.generate(req.request_id, req.prompt_token_ids, req.sampling,
                                                      kv_blocks=pooled, kv_start_block=local,
                                                      block_keys=keys if self.local_cache else (),
                                                      prefill_only=True):
                    outputs.append(out)
            except asyncio.CancelledError:
                await self.engine.abort(req.request_id)
                raise
            span.set_attribute("halfmoon.tokens_computed", len(req.prompt_token_ids) - outputs[-1].num_cached_tokens)
            return outputs[-1]

    async def _publish_cache_events(self, sample: tuple[int, int, float]) -> None:
        """Tell the conductor what the local prefix cache gained and lost, and how long prefill took."""
        assert self.engine is not None
        stored, evicted = await self.engine.call(lambda e: e.take_cache_events())
        await self.publish(self.subjects.kv_events, KVEvents(instance_id=self.instance_id, stored=tuple(stored),
                                                             evicted=tuple(evicted), prefill_samples=(sample,)))

    async def _on_snapshot_request(self, _request: SnapshotRequest, _headers: Mapping[str, str]) -> None:
        assert self.engine is not None
        held = await self.engine.call(lambda e: e.cached_block_keys())
        await self.publish(self.subjects.kv_events, KVEvents(instance_id=self.instance_id, stored=tuple(held),
                                                             snapshot=True))

    async def start(self) -> None:
        await super().start()
        await self.listen(self.subjects.kv_snapshot, codecs.KV_SNAPSHOT_REQUEST, self._on_snapshot_request)
        await self._on_snapshot_request(SnapshotRequest(), {})

    async def _hand_off(self, req: PrefillRequest, first: RequestOutput, keys: list[bytes], local: int,
                        fetched: Fetched) -> None:
        assert self.engine is not None
        rid = req.request_id
        try:
            payloads = await self.engine.call(lambda e: e.export_kv(rid))
        finally:
            await self.engine.call(lambda e: e.release(rid))
        kv = await self.handoff.send(rid, len(req.prompt_token_ids), self.config.block_size, keys, payloads, local,
                                     fetched)
        handoff = DecodeRequest(
            request_id=rid, prompt_token_ids=req.prompt_token_ids, first_token_id=first.new_token_ids[0],
            first_logprob=first.new_logprobs[0] if req.sampling.logprobs else None, sampling=req.sampling, kv=kv,
            stream_subject=req.stream_subject, prefill_instance=self.instance_id, deadline=req.deadline,
            cached_tokens=first.num_cached_tokens,
        )
        try:
            await self.request(self.subjects.decode_submit(req.decode_instance), handoff, codecs.SUBMIT_REPLY,
                               HANDOFF_TIMEOUT_S)
        except RemoteError:
            await self.handoff.discard(rid, len(payloads))
            raise
