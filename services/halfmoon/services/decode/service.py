"""Decode instance: pulls a prefilled request's KV from the pool and transfer nodes, joins the
running batch, and streams tokens to the requester until a stop condition."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from halfmoon.core.errors import EngineError
from halfmoon.core.block_format import verify_block
from halfmoon.protocol import codecs
from halfmoon.protocol.base import ErrorCode
from halfmoon.protocol.registry import Role
from halfmoon.protocol.work import BlockLocation, DecodeRequest
from halfmoon.service.streaming import handoff_key, token_event
from halfmoon.service.worker import EngineWorker
from halfmoon.storage.base import StorageError
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.transport import TransferError


class DecodeService(EngineWorker):
    role = Role.DECODE
    submit_codec = codecs.DECODE_REQUEST

    @property
    def submit_subject(self) -> str:
        return self.subjects.decode_submit(self.instance_id)

    def accept(self, request: DecodeRequest):  # type: ignore[no-untyped-def, override]
        return self._serve(request)

    async def _serve(self, req: DecodeRequest) -> None:
        payloads = await self._pull_kv(req)
        try:
            await self._generate(req, payloads)
        except EngineError as exc:
            await self.send_error(req.stream_subject, req.request_id, ErrorCode.BAD_REQUEST, str(exc))

    async def _pull_kv(self, req: DecodeRequest) -> list[bytes]:
        """The longest intact prefix of the request's KV; whatever is lost is recomputed here."""
        assert self.engine is not None
        locations = list(req.kv.blocks) + ([req.kv.partial] if req.kv.partial else [])
        by_node: dict[str, list[tuple[int, BlockLocation]]] = defaultdict(list)
        for index, location in enumerate(locations):
            by_node[location.node].append((index, location))
        scratch = {handoff_key(req.request_id, i) for i in range(len(locations))}
        payloads: list[bytes | None] = [None] * len(locations)
        with self.tracer.start_as_current_span("decode.kv_read") as span:
            for node, entries in by_node.items():
                keys = [loc.key or b"" for _, loc in entries]
                try:
                    transport = await self.transfer.transport(node)
                    views = await transport.read(keys, missing_ok=True)
                except (TransferError, StorageError, OSError) as exc:
                    self.log.warning("KV source unreachable; recomputing", extra={"node": node, "error": str(exc)})
                    METRICS.errors.labels("kv_read").inc()
                    continue
                for (index, _), view in zip(entries, views):
                    if view is not None and verify_block(self.engine.layout, view):
                        payloads[index] = bytes(view)
            await self._drop_scratch(by_node, scratch)
            usable = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
            span.set_attribute("halfmoon.blocks", usable)
            span.set_attribute("halfmoon.blocks_lost", len(payloads) - usable)
            span.set_attribute("halfmoon.bytes", sum(len(p) for p in payloads[:usable] if p is not None))
        return [p for p in payloads[:usable] if p is not None]

    async def _drop_scratch(self, by_node: dict[str, list[tuple[int, BlockLocation]]], scratch: set[bytes]) -> None:
        """One-off hand-off blocks are read once: out of the pool's index, then off the nodes
        (those parked outside the pool are only on the nodes)."""
        await self.pool.remove([loc.key for entries in by_node.values() for _, loc in entries if loc.key in scratch])
        for node, entries in by_node.items():
            keys = [loc.key for _, loc in entries if loc.key in scratch]
            if keys:
                try:
                    await (await self.transfer.transport(node)).delete(keys)
                except (TransferError, StorageError, OSError):
                    pass  # the node is gone, and the blocks with it

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
