"""Decode instance: pulls a prefilled request's KV from the transfer node, joins the running
batch, and streams tokens to the requester until a stop condition."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from shared.engine.errors import EngineError
from shared.protocol import codecs
from shared.protocol.base import ErrorCode
from shared.protocol.registry import Role
from shared.protocol.work import BlockLocation, DecodeRequest
from shared.service.streaming import token_event
from shared.service.worker import EngineWorker
from shared.transfer.transport import TransferError
from shared.storage.base import BlockNotFound


class DecodeService(EngineWorker):
    role = Role.DECODE
    submit_codec = codecs.DECODE_REQUEST

    @property
    def submit_subject(self) -> str:
        return self.subjects.decode_submit(self.instance_id)

    def accept(self, request: DecodeRequest):  # type: ignore[no-untyped-def, override]
        return self._serve(request)

    async def _serve(self, req: DecodeRequest) -> None:
        try:
            payloads = await self._pull_kv(req)
        except (TransferError, BlockNotFound, OSError) as exc:
            await self.send_error(req.stream_subject, req.request_id, ErrorCode.UNAVAILABLE,
                                  f"could not fetch the request's KV: {exc}")
            return
        try:
            await self._generate(req, payloads)
        except EngineError as exc:
            await self.send_error(req.stream_subject, req.request_id, ErrorCode.BAD_REQUEST, str(exc))

    async def _pull_kv(self, req: DecodeRequest) -> list[bytes]:
        locations = list(req.kv.blocks) + ([req.kv.partial] if req.kv.partial else [])
        by_node: dict[str, list[tuple[int, BlockLocation]]] = defaultdict(list)
        for index, location in enumerate(locations):
            by_node[location.node].append((index, location))
        payloads: list[bytes] = [b""] * len(locations)
        with self.tracer.start_as_current_span("decode.kv_read") as span:
            for node, entries in by_node.items():
                transport = await self.transfer.transport(node)
                keys = [loc.key for _, loc in entries if loc.key is not None]
                views = await transport.read(keys)
                for (index, _), view in zip(entries, views):
                    payloads[index] = bytes(view)  # type: ignore[arg-type]
                await transport.delete(keys)
            span.set_attribute("halfmoon.bytes", sum(len(p) for p in payloads))
            span.set_attribute("halfmoon.blocks", len(payloads))
        return payloads

    async def _generate(self, req: DecodeRequest, payloads: list[bytes]) -> None:
        assert self.engine is not None
        with self.tracer.start_as_current_span("decode.generate") as span:
            span.set_attribute("halfmoon.request_id", req.request_id)
            produced = 0
            try:
                async for out in self.engine.generate(req.request_id, req.prompt_token_ids, req.sampling,
                                                      output_token_ids=[req.first_token_id], kv_blocks=payloads):
                    produced += len(out.new_token_ids)
                    await self.publish(req.stream_subject,
                                       token_event(out, req.sampling, self.instance_id, req.cached_tokens))
            except asyncio.CancelledError:
                await self.engine.abort(req.request_id)
                raise
            span.set_attribute("halfmoon.tokens_generated", produced)
