"""Prefill instance: reuses the prompt's cached prefix from the pool, computes the rest, stores the
new full blocks back, and hands the request to the decode instance the conductor chose."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

from opentelemetry.trace import TracerProvider

from halfmoon.core.errors import EngineError
from halfmoon.engine.interface import NO_KV, PREFILL_DONE, RequestOutput
from halfmoon.protocol import codecs
from halfmoon.protocol.base import ErrorCode, RemoteError
from halfmoon.protocol.registry import Role
from halfmoon.protocol.subjects import Subjects
from halfmoon.protocol.work import DecodeRequest, KVLocation, PrefillRequest
from halfmoon.runtime.layer_writer import LayerWriter
from halfmoon.runtime.prefix_layers import PrefixLayers
from halfmoon.runtime.prefix_reuse import Prefix, PrefixReuse
from halfmoon.runtime.rpc import RECONNECT_GRACE_S
from halfmoon.runtime.streaming import token_event
from halfmoon.runtime.worker import EngineWorker, WorkerConfig
from halfmoon.services.prefill.pipeline import PipelineHead, StageServer
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.transport import TransferError

HANDOFF_TIMEOUT_S = 10.0


class PrefillService(EngineWorker):
    role = Role.PREFILL
    submit_codec = codecs.PREFILL_REQUEST

    def __init__(self, config: WorkerConfig, tracer_provider: TracerProvider | None = None) -> None:
        super().__init__(config, tracer_provider)
        self.prefix = PrefixReuse(self)
        self.pipeline = PipelineHead(self, self.prefix, self.send_to_decode)  # CPP: requests submitted with one
        self.stages = StageServer(self)  # CPP: the later stages of other instances' requests

    @property
    def submit_subject(self) -> str:
        return self.subjects.prefill_submit_to(self.instance_id)

    def issuer(self, request: PrefillRequest, subject: str) -> str:
        return Subjects.submitter(subject)  # each gateway's NATS user may submit only naming itself

    def accept(self, request: PrefillRequest, gateway: str) -> Coroutine[Any, Any, None]:
        return self._serve(request, gateway)

    def writer(self, req: PrefillRequest, prefix: Prefix) -> LayerWriter:
        """Ships each layer of the request's new blocks to the pool as the engine finishes it, and tells
        the decode instance (KVProgress)."""
        context = len(req.prompt_token_ids) + len(req.output_token_ids)
        subject = self.subjects.decode_kv(req.decode_instance)
        return self.handoff.writer(req.request_id, context, self.config.block_size, prefix.keys, prefix.local,
                                   prefix.fetched, lambda msg: self.publish(subject, msg),
                                   self.config.layerwise_handoff)

    async def _serve(self, req: PrefillRequest, gateway: str) -> None:
        if req.pipeline and not req.output_token_ids:  # a migrated request continues on one instance
            await self.pipeline.serve(req, gateway)
            return
        assert self.engine is not None
        stream = self.subjects.stream(gateway, req.request_id)
        started = time.perf_counter()
        prefix = await self.prefix.fetch(req)
        context = len(req.prompt_token_ids) + len(req.output_token_ids)
        # An engine that moves its own KV (pool_kv) has stored the prompt's full blocks in the pool by its
        # first token: the hand-off is that token, and decode's engine reads the blocks by their keys.
        writer = None if self.engine.pool_kv else self.writer(req, prefix)
        # its put_start overlaps the compute
        shipping = asyncio.create_task(writer.run(req.tenant)) if writer is not None else None
        try:
            try:
                first = await self._compute(req, prefix, writer)
            except EngineError as exc:
                await self.send_error(stream, req.request_id, ErrorCode.BAD_REQUEST, str(exc), req.attempt)
                return
            finished = time.perf_counter()
            self.done_computing(req.request_id)
            # NOTE: the first token's event goes out before the hand-off: decode's tokens follow it
            await self.publish_event(stream, token_event(first, req.sampling, self.instance_id,
                                                         first.num_cached_tokens, req.attempt))
            self.record_ttft(finished - started)
            cached = first.num_cached_tokens
            layers = prefix.fetched.layers
            if isinstance(layers, PrefixLayers) and not await layers.wait():  # a layer failed: written again
                await self._store_recomputed(req, prefix)
            try:
                if first.finish_reason == PREFILL_DONE and writer is None:
                    await self.send_to_decode(req, gateway, first, None, 0)
                elif first.finish_reason == PREFILL_DONE:
                    assert writer is not None and shipping is not None
                    await self._hand_off(req, gateway, first, writer, shipping)
            finally:  # for the conductor's index, not this request: after the hand-off
                await self.prefix.publish_cache_events((context - cached, cached, first.compute_s))
        except (RemoteError, TransferError, OSError, EngineError) as exc:
            # NOTE: anything but a refusal of the request itself is retryable: the gateway migrates it
            bad = isinstance(exc, (RemoteError, EngineError)) and getattr(exc, "code", None) is ErrorCode.BAD_REQUEST
            code = ErrorCode.BAD_REQUEST if bad else ErrorCode.UNAVAILABLE
            await self.send_error(stream, req.request_id, code, f"hand-off to decode failed: {exc}", req.attempt)
        finally:
            if shipping is not None:
                shipping.cancel()
            await self.pool.release(prefix.fetched.lease_id)

    async def _compute(self, req: PrefillRequest, prefix: Prefix, writer: LayerWriter | None) -> RequestOutput:
        assert self.engine is not None
        with self.tracer.start_as_current_span("prefill.compute") as span:
            span.set_attribute("halfmoon.request_id", req.request_id)
            span.set_attribute("halfmoon.prompt_tokens", len(req.prompt_token_ids))
            span.set_attribute("halfmoon.blocks_hit_local", prefix.local)
            span.set_attribute("halfmoon.blocks_hit", prefix.reused)
            span.set_attribute("halfmoon.prefix_layerwise", prefix.fetched.layers is not None)
            outputs = []
            try:
                async for out in self.engine.generate(req.request_id, req.prompt_token_ids, req.sampling,
                                                      output_token_ids=req.output_token_ids,
                                                      block_keys=self.prefix.prompt_keys(req, prefix.keys),
                                                      tenant_salt=req.tenant_salt, prefill_only=True,
                                                      kv=NO_KV if writer is None
                                                      else prefix.kv(writer.sink, writer.first_block)):
                    outputs.append(out)
            except asyncio.CancelledError:
                await self.engine.abort(req.request_id)
                raise
            context = len(req.prompt_token_ids) + len(req.output_token_ids)
            span.set_attribute("halfmoon.tokens_computed", context - outputs[-1].num_cached_tokens)
            if req.attempt:
                span.set_attribute("halfmoon.attempt", req.attempt)
            return outputs[-1]

    async def _store_recomputed(self, req: PrefillRequest, prefix: Prefix) -> None:
        """The pool's blocks whose layers did not arrive intact, written again from the KV the engine
        recomputed in their place (the damaged ones were reported and dropped): the next request reuses
        them, and the hand-off points decode at the new copies, not at the damaged ones."""
        assert self.engine is not None
        fetched, start = prefix.fetched, prefix.local
        try:
            payloads = await self.engine.export_kv(req.request_id, start, start + len(fetched.locations))
        except EngineError:
            return  # gone meanwhile: the next computation of this prefix writes them
        keys = prefix.keys[start:start + len(payloads)]
        stored = await self.pool.store(keys, payloads, first_position=start, tenant=req.tenant)
        for index, key in enumerate(keys):
            if key in stored:
                fetched.locations[index] = stored[key]

    async def start(self) -> None:
        await super().start()
        await self.serve(self.subjects.prefill_stage(self.instance_id), codecs.STAGE_WORK, self.stages.on_work,
                         span_name="prefill.stage")
        self.stages.start()
        await self.prefix.start()

    async def close(self) -> None:
        await self.stages.stop()
        await super().close()

    async def _hand_off(self, req: PrefillRequest, gateway: str, first: RequestOutput, writer: LayerWriter,
                        shipping: asyncio.Task[None]) -> None:
        assert self.engine is not None
        rid = req.request_id
        try:
            await shipping  # every layer is out of the engine and shipped
        finally:
            await self.engine.release(rid)
        kv = await self._place_kv(writer)
        deferred = kv is not None and writer.complete  # decode holds every block: commit after the hand-off
        try:
            await self.send_to_decode(req, gateway, first, kv, writer.announced if kv is not None else 0)
        finally:
            if deferred:
                await self.handoff.commit(writer)

    async def send_to_decode(self, req: PrefillRequest, gateway: str, first: RequestOutput, kv: KVLocation | None,
                             layers_announced: int) -> None:
        """Hand the request to its decode instance: the first token, where its KV is, and the gateway it
        streams to (``gateway``, as the submit's subject named it)."""
        rid = req.request_id
        handoff = DecodeRequest(
            request_id=rid, prompt_token_ids=req.prompt_token_ids, first_token_id=first.new_token_ids[0],
            first_logprob=first.new_logprobs[0] if req.sampling.logprobs else None, sampling=req.sampling, kv=kv,
            gateway=gateway, prefill_instance=self.instance_id, deadline=req.deadline,
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
