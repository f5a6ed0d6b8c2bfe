"""Prefill instance: reuses the prompt's cached prefix from the pool, computes the rest, stores the
new full blocks back, and hands the request to the decode instance the conductor chose."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import NamedTuple

from halfmoon.core.errors import EngineError
from halfmoon.engine.engine import PREFILL_DONE, RequestOutput
from halfmoon.protocol import codecs
from halfmoon.protocol.base import ErrorCode, RemoteError
from halfmoon.protocol.pool import KVEvents, SnapshotRequest
from halfmoon.protocol.registry import Role
from halfmoon.protocol.work import DecodeRequest, KVLocation, PrefillRequest
from halfmoon.runtime.layer_writer import LayerWriter
from halfmoon.runtime.pool_client import Fetched
from halfmoon.runtime.prefix_layers import PrefixLayers
from halfmoon.runtime.rpc import RECONNECT_GRACE_S
from halfmoon.runtime.streaming import token_event
from halfmoon.runtime.worker import EngineWorker, WorkerConfig
from halfmoon.services.prefill.pipeline import PipelineHead, StageServer
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.transport import TransferError
from opentelemetry.trace import TracerProvider

HANDOFF_TIMEOUT_S = 10.0


class Prefix(NamedTuple):
    keys: list[bytes]  # of the request's full blocks (prompt and delivered output)
    local: int  # leading blocks in the local prefix cache
    fetched: Fetched  # the blocks after those that the pool had


class PrefillService(EngineWorker):
    role = Role.PREFILL
    submit_codec = codecs.PREFILL_REQUEST

    def __init__(self, config: WorkerConfig, tracer_provider: TracerProvider | None = None) -> None:
        super().__init__(config, tracer_provider)
        self.pipeline = PipelineHead(self)  # CPP: requests submitted here with a pipeline
        self.stages = StageServer(self)  # CPP: the later stages of other instances' requests

    @property
    def submit_subject(self) -> str:
        return self.subjects.prefill_submit(self.instance_id)

    def accept(self, request: PrefillRequest):  # type: ignore[no-untyped-def, override]
        return self._serve(request)

    @property
    def local_cache(self) -> bool:
        return self.config.local_prefix_cache

    def block_keys(self, req: PrefillRequest) -> list[bytes]:
        """Keys of the full blocks of the prompt and the tokens a migrated request already produced."""
        assert self.engine is not None
        return self.engine.kv_spec.hasher(req.tenant_salt).keys(req.prompt_token_ids + req.output_token_ids)

    async def fetch_prefix(self, req: PrefillRequest) -> Prefix:
        """The request's block keys, and how much of its prefix is in the local cache and in the pool."""
        assert self.engine is not None
        keys = self.block_keys(req)
        context = len(req.prompt_token_ids) + len(req.output_token_ids)
        # The last token is always computed: its logits give the next output token.
        reusable = keys[: (context - 1) // self.config.block_size]
        # Local prefix cache first (it keys prompt blocks only); the pool supplies what follows it.
        prompt_blocks = reusable[: len(req.prompt_token_ids) // self.config.block_size]
        local = self.engine.cached_prefix_blocks(prompt_blocks) if self.local_cache else 0
        fetched = await self.fetch_pooled(reusable[local:])
        METRICS.cache_hit_blocks.labels(self.role.value).inc(local + len(fetched.payloads))
        METRICS.cache_miss_blocks.labels(self.role.value).inc(len(reusable) - local - len(fetched.payloads))
        return Prefix(keys, local, fetched)

    async def fetch_pooled(self, keys: list[bytes]) -> Fetched:
        """The pool's part of the prefix: read layer by layer during the compute where its nodes move
        byte ranges (``layerwise_prefix``), else whole before it."""
        found = await self.pool.lookup(keys)
        if found is None:
            return Fetched([], [], None)
        first = [hit.replicas[0] for hit in found.hits]
        if not (first and self.config.layerwise_prefix and await self.pool.ranged(first)):
            return await self.pool.read_prefix(found)
        layers = PrefixLayers(self.pool.layout, first, self.config.block_size, self.transfer, self.tracer, self.log)
        layers.start()
        return Fetched(layers.payloads, first, found.lease_id, layers)

    def prompt_keys(self, req: PrefillRequest, keys: list[bytes]) -> list[bytes]:
        """The keys the engine caches the prompt's full blocks under (none without a local cache)."""
        return keys[: len(req.prompt_token_ids) // self.config.block_size] if self.local_cache else []

    def record_ttft(self, seconds: float) -> None:
        self.meter.on_first_token(seconds)
        METRICS.ttft.labels(self.instance_id).observe(seconds)

    def writer(self, req: PrefillRequest, keys: list[bytes], local: int, fetched: Fetched) -> LayerWriter:
        """Ships each layer of the request's new blocks to the pool as the engine finishes it, and tells
        the decode instance (KVProgress)."""
        context = len(req.prompt_token_ids) + len(req.output_token_ids)
        subject = self.subjects.decode_kv(req.decode_instance)
        return self.handoff.writer(req.request_id, context, self.config.block_size, keys, local, fetched,
                                   lambda msg: self.publish(subject, msg), self.config.layerwise_handoff)

    async def _serve(self, req: PrefillRequest) -> None:
        if req.pipeline and not req.output_token_ids:  # a migrated request continues on one instance
            await self.pipeline.serve(req)
            return
        started = time.perf_counter()
        keys, local, fetched = await self.fetch_prefix(req)
        context = len(req.prompt_token_ids) + len(req.output_token_ids)
        writer = self.writer(req, keys, local, fetched)
        shipping = asyncio.create_task(writer.run(req.tenant))  # its put_start overlaps the compute
        try:
            try:
                first = await self._compute(req, keys, local, fetched, writer)
            except EngineError as exc:
                await self.send_error(self.stream_of(req), req.request_id, ErrorCode.BAD_REQUEST, str(exc),
                                      req.attempt)
                return
            finished = time.perf_counter()
            self.done_computing(req.request_id)
            # NOTE: the first token's event goes out before the hand-off: decode's tokens follow it
            await self.publish_event(self.stream_of(req), token_event(first, req.sampling, self.instance_id,
                                                                     first.num_cached_tokens, req.attempt))
            self.record_ttft(finished - started)
            cached = first.num_cached_tokens
            try:
                if first.finish_reason == PREFILL_DONE:
                    await self._hand_off(req, first, writer, shipping)
            finally:  # for the conductor's index, not this request: after the hand-off
                await self.publish_cache_events((context - cached, cached, first.compute_s))
        except (RemoteError, TransferError, OSError, EngineError) as exc:
            # NOTE: anything but a refusal of the request itself is retryable: the gateway migrates it
            bad = isinstance(exc, (RemoteError, EngineError)) and getattr(exc, "code", None) is ErrorCode.BAD_REQUEST
            code = ErrorCode.BAD_REQUEST if bad else ErrorCode.UNAVAILABLE
            await self.send_error(self.stream_of(req), req.request_id, code, f"hand-off to decode failed: {exc}",
                                  req.attempt)
        finally:
            shipping.cancel()
            await self.pool.release(fetched.lease_id)

    async def _compute(self, req: PrefillRequest, keys: list[bytes], local: int,
                       fetched: Fetched, writer: LayerWriter) -> RequestOutput:
        assert self.engine is not None
        with self.tracer.start_as_current_span("prefill.compute") as span:
            span.set_attribute("halfmoon.request_id", req.request_id)
            span.set_attribute("halfmoon.prompt_tokens", len(req.prompt_token_ids))
            span.set_attribute("halfmoon.blocks_hit_local", local)
            span.set_attribute("halfmoon.blocks_hit", local + len(fetched.payloads))
            span.set_attribute("halfmoon.prefix_layerwise", fetched.layers is not None)
            outputs = []
            try:
                async for out in self.engine.generate(req.request_id, req.prompt_token_ids, req.sampling,
                                                      output_token_ids=req.output_token_ids,
                                                      kv_blocks=[] if fetched.layers else fetched.payloads,
                                                      kv_layers=fetched.layers, kv_start_block=local,
                                                      block_keys=self.prompt_keys(req, keys), prefill_only=True,
                                                      layer_sink=writer.sink, stream_from_block=writer.first_block):
                    outputs.append(out)
            except asyncio.CancelledError:
                await self.engine.abort(req.request_id)
                raise
            context = len(req.prompt_token_ids) + len(req.output_token_ids)
            span.set_attribute("halfmoon.tokens_computed", context - outputs[-1].num_cached_tokens)
            if req.attempt:
                span.set_attribute("halfmoon.attempt", req.attempt)
            return outputs[-1]

    async def publish_cache_events(self, sample: tuple[int, int, float]) -> None:
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
        if self.role is Role.PREFILL:  # aggregated instances are never pipeline stages
            await self.serve(self.subjects.prefill_stage(self.instance_id), codecs.STAGE_WORK, self.stages.on_work,
                             span_name="prefill.stage")
            self.stages.start()
        await self.listen(self.subjects.kv_snapshot, codecs.KV_SNAPSHOT_REQUEST, self._on_snapshot_request)
        await self._on_snapshot_request(SnapshotRequest(), {})

    async def close(self) -> None:
        await self.stages.stop()
        await super().close()

    async def _hand_off(self, req: PrefillRequest, first: RequestOutput, writer: LayerWriter,
                        shipping: asyncio.Task[None]) -> None:
        assert self.engine is not None
        rid = req.request_id
        try:
            await shipping  # every layer is out of the engine and shipped
        finally:
            await self.engine.call(lambda e: e.release(rid))
        kv = await self._place_kv(writer)
        deferred = kv is not None and writer.complete  # decode holds every block: commit after the hand-off
        try:
            await self.send_to_decode(req, first, kv, writer.announced if kv is not None else 0)
        finally:
            if deferred:
                await self.handoff.commit(writer)

    async def send_to_decode(self, req: PrefillRequest, first: RequestOutput, kv: KVLocation | None,
                             layers_announced: int) -> None:
        """Hand the request to its decode instance: the first token, and where its KV is."""
        rid = req.request_id
        handoff = DecodeRequest(
            request_id=rid, prompt_token_ids=req.prompt_token_ids, first_token_id=first.new_token_ids[0],
            first_logprob=first.new_logprobs[0] if req.sampling.logprobs else None, sampling=req.sampling, kv=kv,
            gateway=req.gateway, prefill_instance=self.instance_id, deadline=req.deadline,
            cached_tokens=min(first.num_cached_tokens, len(req.prompt_token_ids)),
            output_token_ids=req.output_token_ids, attempt=req.attempt, tenant_salt=req.tenant_salt,
            layers_announced=layers_announced,
        )
        try:
            await self.request(self.subjects.decode_submit(req.decode_instance), handoff, codecs.SUBMIT_REPLY,
                               HANDOFF_TIMEOUT_S, responder_grace_s=RECONNECT_GRACE_S)
        except RemoteError:
            if kv is not None:
                await self.handoff.discard(rid, len(kv.blocks) + (kv.partial is not None))
            raise

    async def _place_kv(self, writer: LayerWriter) -> KVLocation | None:
        """Where decode finds the KV; None when nothing could take it (no live transfer node): decode then
        recomputes it, slower but served, and the gauge says the pool is out until a hand-off works again."""
        try:
            kv = await self.handoff.send(writer)
        except (RemoteError, TransferError, OSError) as exc:
            self.log.warning("KV hand-off without the pool: decode recomputes",
                             extra={"request_id": writer.request_id, "error": str(exc)})
            METRICS.handoffs_without_pool.inc()
            METRICS.pool_available.labels(self.instance_id).set(0)
            return None
        METRICS.pool_available.labels(self.instance_id).set(1)
        return kv
