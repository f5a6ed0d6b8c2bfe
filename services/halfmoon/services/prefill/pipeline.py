"""Chunked pipeline-parallel prefill (CPP), live: the head drives a request through the stages, every
prefill instance serves the stages it is asked to run.

The head (the instance the request was submitted to) cuts the prompt into chunks, runs its layers over
each and sends the hidden states to stage 1 (StageWork over NATS request/reply), without waiting: it
computes chunk ``c + 1`` while stage 1 computes chunk ``c``. A stage runs its layers (keeping their KV
for the later chunks), passes its output to the next stage, and the last one samples the first token.
With the chunk that ends the prompt every stage writes its layers of the request's blocks into the
extents the head reserved (runtime/stage_blocks.py); the head commits them and hands off to decode.
Chunks are at most ``prefill_chunk_size`` tokens, fewer where their hidden states would not fit in
one NATS message.

Both parts work for an engine worker and are handed what they use of the prefill service (its prefix
lookups, its hand-off to decode); the service owns them, they never see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import TypedDict

import msgspec
import torch

from halfmoon.core.errors import EngineError
from halfmoon.engine.interface import (
    PREFILL_DONE,
    RequestOutput,
    StageChunk,
    StageResult,
    hidden_bytes,
    hidden_tensor,
    split_layers,
)
from halfmoon.protocol import codecs
from halfmoon.protocol.base import ErrorCode, ErrorReply, Message, RemoteError
from halfmoon.protocol.pipeline import StageDone, StageWork, chunk_tokens
from halfmoon.protocol.work import BlockLocation, KVLocation, PrefillRequest
from halfmoon.runtime.pool_client import Fetched
from halfmoon.runtime.prefix_reuse import PrefixReuse
from halfmoon.runtime.stage_blocks import PipelineBlocks, write_stage_layers
from halfmoon.runtime.streaming import token_event
from halfmoon.runtime.worker import EngineWorker
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.transport import TransferError

SendToDecode = Callable[[PrefillRequest, str, RequestOutput, KVLocation | None, int], Awaitable[None]]
"""Hands a prefilled request to its decode instance: the first token, where its KV is, layers announced."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class StageWorkExtras(TypedDict, total=False):
    """The StageWork fields only the first chunk (the reused prefix) or the last (the blocks) carries."""

    prefix_token_ids: tuple[int, ...]
    prefix: tuple[BlockLocation, ...]
    block_indexes: tuple[int, ...]
    blocks: tuple[BlockLocation, ...]
    salts: tuple[bytes, ...]


class PipelineHead:
    """Stage 0 of the requests submitted here with a ``pipeline``."""

    def __init__(self, worker: EngineWorker, prefix: PrefixReuse, send_to_decode: SendToDecode) -> None:
        self.worker = worker
        self.prefix = prefix
        self.send_to_decode = send_to_decode

    def chunk_tokens(self) -> int:
        worker = self.worker
        assert worker.engine is not None
        return chunk_tokens(worker.config.prefill_chunk_size, worker.nc.max_payload,
                            worker.engine.hidden_size * worker.engine.dtype.itemsize)

    async def serve(self, req: PrefillRequest, gateway: str) -> None:
        worker = self.worker
        started = time.perf_counter()
        keys = self.prefix.block_keys(req)
        fetched = await worker.pool.fetch_prefix(keys[:(len(req.prompt_token_ids) - 1) // worker.config.block_size])
        try:  # NOTE: the lease keeps the reused prefix in the pool until decode was handed its locations
            await self._serve(req, gateway, keys, fetched, started)
        finally:
            await worker.pool.release(fetched.lease_id)

    async def _serve(self, req: PrefillRequest, gateway: str, keys: list[bytes], fetched: Fetched,
                     started: float) -> None:
        worker, stream = self.worker, self.worker.subjects.stream(gateway, req.request_id)
        try:
            first, blocks, written = await self._compute(req, keys, fetched)
        except (EngineError, ValueError) as exc:
            await worker.send_error(stream, req.request_id, ErrorCode.BAD_REQUEST, str(exc), req.attempt)
            return
        except (RemoteError, TransferError, OSError) as exc:  # a stage failed: the gateway migrates the request
            await worker.send_error(stream, req.request_id, ErrorCode.UNAVAILABLE, f"pipelined prefill failed: {exc}",
                                    req.attempt)
            return
        worker.done_computing(req.request_id)
        await worker.publish_event(stream, token_event(first, req.sampling, worker.instance_id,
                                                       first.num_cached_tokens, req.attempt))
        worker.record_ttft(time.perf_counter() - started)
        kv = await blocks.finish(written)
        if first.finish_reason != PREFILL_DONE:
            return
        if kv is None:
            worker.log.warning("pipelined prefill without complete blocks in the pool: decode recomputes",
                            extra={"request_id": req.request_id})
        try:
            await self.send_to_decode(req, gateway, first, kv, 0)
        except (RemoteError, TransferError, OSError) as exc:
            await worker.send_error(stream, req.request_id, ErrorCode.UNAVAILABLE, f"hand-off to decode failed: {exc}",
                                    req.attempt)

    async def _compute(self, req: PrefillRequest, keys: list[bytes],
                       fetched: Fetched) -> tuple[RequestOutput, PipelineBlocks, set[int]]:
        worker, rid, prompt = self.worker, req.request_id, req.prompt_token_ids
        engine = worker.engine
        assert engine is not None
        stages = (worker.instance_id, *req.pipeline)
        if len(set(stages)) != len(stages):
            raise ValueError(f"a pipeline's stages are distinct instances, got {stages}")
        bounds = split_layers(engine.layout.num_layers, len(stages))
        mine = range(bounds[1])
        blocks = PipelineBlocks(worker.pool, worker.transfer, rid, worker.config.block_size, len(prompt), keys,
                                fetched.locations)
        opening = asyncio.create_task(blocks.open(req.tenant))  # put_start overlaps the first chunks
        sends: list[asyncio.Task[StageDone]] = []
        cached = len(fetched.payloads) * worker.config.block_size
        size = self.chunk_tokens()
        try:
            with worker.tracer.start_as_current_span("prefill.pipeline") as span:
                span.set_attribute("halfmoon.request_id", rid)
                span.set_attribute("halfmoon.stages", ",".join(stages))
                span.set_attribute("halfmoon.blocks_hit", len(fetched.payloads))
                for index, start in enumerate(range(cached, len(prompt), size)):
                    part = prompt[start:start + size]
                    prefix = dict(prefix_token_ids=prompt[:cached]) if index == 0 else {}
                    out = await engine.run_stage(StageChunk(rid, part, start, mine, None, len(prompt), req.sampling,
                                                            prefix_blocks=fetched.payloads if index == 0 else (),
                                                            **prefix))
                    METRICS.pipeline_chunks.labels("0").inc()
                    extra: StageWorkExtras = ({"prefix_token_ids": prompt[:cached], "prefix": tuple(fetched.locations)}
                                              if index == 0 else {})
                    last = start + len(part) == len(prompt)
                    if last:
                        await opening
                        indexes = tuple(sorted(blocks.placed))
                        extra["block_indexes"] = indexes
                        extra["blocks"] = tuple(blocks.placed[i] for i in indexes)
                        extra["salts"] = tuple(blocks.salts[i] for i in indexes)
                    assert out.hidden is not None
                    work = StageWork(request_id=rid, attempt=req.attempt, stages=stages, layer_bounds=bounds, stage=1,
                                     index=index, start=start, token_ids=part, prompt_len=len(prompt),
                                     hidden=hidden_bytes(out.hidden), dtype=dtype_name(engine.dtype),
                                     sampling=req.sampling, deadline=req.deadline, last=last, **extra)
                    sends.append(asyncio.create_task(worker.request(
                        worker.subjects.prefill_stage(stages[1]), work, codecs.STAGE_REPLY,
                        max(1.0, req.deadline - time.time()))))
                # the head's layers of every block go out while the later stages run the last chunk
                written = await blocks.write(await engine.stage_payloads(rid, mine), mine)
                replies = await asyncio.gather(*sends)
                span.set_attribute("halfmoon.chunks", len(sends))
        finally:
            for task in (opening, *sends):
                task.cancel()
            await engine.release_stage(rid)
        final = replies[-1]
        if final.token_id is None or final.logprob is None:
            raise RemoteError(ErrorReply(code=ErrorCode.INTERNAL, message="the last stage sampled no token"))
        first = RequestOutput(rid, [final.token_id], [final.logprob], final.text, final.finish_reason != PREFILL_DONE,
                              final.finish_reason, len(prompt), cached, 1)
        return first, blocks, written & set(final.written)


class StageServer:
    """Stages ``>= 1`` of other instances' pipelines. Contract: chunks of a request arrive in order (one
    subscription, handled one after another); a request's layers leave the engine with its last chunk,
    or when its deadline passes (a head that died never sends it)."""

    SWEEP_S = 1.0

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self._deadlines: dict[str, float] = {}
        self._forwards: dict[str, list[asyncio.Task[StageDone]]] = defaultdict(list)
        self._sweeper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="stage-sweeper")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def on_work(self, work: StageWork) -> Message:
        worker, rid = self.worker, work.request_id
        engine = worker.engine
        assert engine is not None
        if work.stages[work.stage] != worker.instance_id or work.dtype != dtype_name(engine.dtype):
            return ErrorReply(code=ErrorCode.BAD_REQUEST, message=f"stage {work.stage} of {work.stages} in "
                              f"{work.dtype} sent to {worker.instance_id} ({dtype_name(engine.dtype)})")
        if work.index == 0 and worker.draining:
            return ErrorReply(code=ErrorCode.UNAVAILABLE, message=f"{worker.instance_id} is draining", retryable=True)
        prefix = await worker.pool.read(work.prefix) if work.prefix else []
        if any(block is None for block in prefix):
            return ErrorReply(code=ErrorCode.UNAVAILABLE, retryable=True,
                              message=f"{worker.instance_id} could not read the reused prefix of {rid}")
        if rid not in self._deadlines:
            worker.begin_computing(rid)  # its load, and its WorkDone, for the conductors' ledgers
        self._deadlines[rid] = work.deadline
        try:
            out = await engine.run_stage(StageChunk(rid, work.token_ids, work.start, work.layers,
                                                    hidden_tensor(work.hidden, len(work.token_ids), engine.dtype),
                                                    work.prompt_len, work.sampling, work.prefix_token_ids,
                                                    [block for block in prefix if block is not None]))
            METRICS.pipeline_chunks.labels(str(work.stage)).inc()
            written = await self._write(work) if work.last else set()
        except EngineError as exc:
            await self._drop(rid, failed=True)
            return ErrorReply(code=ErrorCode.BAD_REQUEST, message=f"{worker.instance_id}: {exc}")
        if work.last:
            await self._drop(rid)
        if work.stage + 1 == len(work.stages):
            return StageDone(request_id=rid, index=work.index, token_id=out.token_id, logprob=out.logprob,
                             text=out.text, finish_reason=out.finish_reason, written=tuple(sorted(written)))
        return await self._forward(work, out, written)

    async def _write(self, work: StageWork) -> set[int]:
        engine = self.worker.engine
        assert engine is not None
        payloads = await engine.stage_payloads(work.request_id, work.layers)
        # NOTE: the pool's layout carries the cluster's MAC key; the engine's does not
        return await write_stage_layers(self.worker.transfer, self.worker.pool.layout,
                                        dict(zip(work.block_indexes, work.blocks)),
                                        dict(zip(work.block_indexes, work.salts)), payloads, work.layers)

    async def _forward(self, work: StageWork, out: StageResult, written: set[int]) -> Message:
        """Send the chunk on to the next stage: without waiting for earlier chunks, but the last chunk's
        answer comes once every chunk is through (the first token, and what every later stage wrote)."""
        worker, rid = self.worker, work.request_id
        assert out.hidden is not None
        keep = tuple(i for i in work.block_indexes if i in written)
        where = dict(zip(work.block_indexes, zip(work.blocks, work.salts)))
        onward = msgspec.structs.replace(work, stage=work.stage + 1, hidden=hidden_bytes(out.hidden),
                                         block_indexes=keep, blocks=tuple(where[i][0] for i in keep),
                                         salts=tuple(where[i][1] for i in keep))
        sending = asyncio.create_task(worker.request(worker.subjects.prefill_stage(work.stages[work.stage + 1]), onward,
                                                  codecs.STAGE_REPLY, max(1.0, work.deadline - time.time())))
        if not work.last:
            self._forwards[rid].append(sending)
            return StageDone(request_id=rid, index=work.index)
        earlier = self._forwards.pop(rid, [])
        try:
            *_, final = await asyncio.gather(*earlier, sending)
        except RemoteError as exc:
            return exc.reply
        return msgspec.structs.replace(final, index=work.index, written=tuple(i for i in final.written if i in written))

    async def _drop(self, request_id: str, failed: bool = False) -> None:
        self._deadlines.pop(request_id, None)
        for task in self._forwards.pop(request_id, []):
            task.cancel()
        assert self.worker.engine is not None
        await self.worker.engine.release_stage(request_id)
        self.worker.done_computing(request_id, failed)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.SWEEP_S)
            now = time.time()
            for rid in [rid for rid, deadline in self._deadlines.items() if deadline < now]:
                self.worker.log.warning("pipeline stage expired: its head never finished it", extra={"request_id": rid})
                await self._drop(rid, failed=True)
