"""Prefill instance: computes a prompt's KV and first token, parks the KV on a transfer node,
and hands the request to the decode instance the conductor chose."""

from __future__ import annotations

import asyncio
import time

from opentelemetry import trace

from shared.engine.engine import PREFILL_DONE, RequestOutput
from shared.engine.errors import EngineError
from shared.protocol import codecs
from shared.protocol.base import ErrorCode, RemoteError
from shared.protocol.registry import Role
from shared.protocol.work import BlockLocation, DecodeRequest, KVLocation, PrefillRequest
from shared.service.streaming import handoff_key, token_event
from shared.service.worker import EngineWorker

TRANSFER_WAIT_S = 10.0
HANDOFF_TIMEOUT_S = 10.0


class PrefillService(EngineWorker):
    role = Role.PREFILL
    submit_codec = codecs.PREFILL_REQUEST

    @property
    def submit_subject(self) -> str:
        return self.subjects.prefill_submit(self.instance_id)

    def accept(self, request: PrefillRequest):  # type: ignore[no-untyped-def, override]
        return self._serve(request)

    async def _serve(self, req: PrefillRequest) -> None:
        assert self.engine is not None
        started = time.perf_counter()
        try:
            first = await self._compute(req)
        except EngineError as exc:
            await self.send_error(req.stream_subject, req.request_id, ErrorCode.BAD_REQUEST, str(exc))
            return
        self.meter.ttft_ms.append((time.perf_counter() - started) * 1000)
        await self.publish(req.stream_subject, token_event(first, req.sampling, self.instance_id, 0))
        if first.finish_reason != PREFILL_DONE:
            return
        try:
            await self._hand_off(req, first)
        except (RemoteError, OSError, EngineError) as exc:
            code = exc.code if isinstance(exc, RemoteError) else ErrorCode.UNAVAILABLE
            await self.send_error(req.stream_subject, req.request_id, code, f"hand-off to decode failed: {exc}")

    async def _compute(self, req: PrefillRequest) -> RequestOutput:
        assert self.engine is not None
        with self.tracer.start_as_current_span("prefill.compute") as span:
            span.set_attribute("halfmoon.request_id", req.request_id)
            span.set_attribute("halfmoon.prompt_tokens", len(req.prompt_token_ids))
            outputs = []
            try:
                async for out in self.engine.generate(req.request_id, req.prompt_token_ids, req.sampling,
                                                      prefill_only=True):
                    outputs.append(out)
            except asyncio.CancelledError:
                await self.engine.abort(req.request_id)
                raise
            span.set_attribute("halfmoon.tokens_computed", len(req.prompt_token_ids) - outputs[-1].num_cached_tokens)
            return outputs[-1]

    async def _hand_off(self, req: PrefillRequest, first: RequestOutput) -> None:
        assert self.engine is not None
        rid = req.request_id
        try:
            payloads = await self.engine.call(lambda e: e.export_kv(rid))
        finally:
            await self.engine.call(lambda e: e.release(rid))
        node = await self.transfer_nodes.choose(TRANSFER_WAIT_S)
        keys = [handoff_key(rid, i) for i in range(len(payloads))]
        with self.tracer.start_as_current_span("prefill.kv_write") as span:
            span.set_attribute("halfmoon.bytes", sum(len(p) for p in payloads))
            span.set_attribute("halfmoon.transfer_node", node.instance_id)
            transport = await self.transfer.transport(node.address)
            await transport.write(keys, payloads)
        locations = [BlockLocation(node=node.address, offset=0, size=len(p), key=k) for k, p in zip(keys, payloads)]
        block_size = self.config.block_size
        full = len(req.prompt_token_ids) // block_size
        kv = KVLocation(block_size=block_size, num_tokens=len(req.prompt_token_ids), blocks=tuple(locations[:full]),
                        partial=locations[full] if len(locations) > full else None)
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
            await transport.delete(keys)
            raise
        trace.get_current_span().set_attribute("halfmoon.decode_instance", req.decode_instance)


