"""Halfmoon's own engine behind the ``Engine`` interface: an LLMEngine stepping in its own thread."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from typing import Any, TypeVar

import torch

from halfmoon.core.block_format import BlockLayout
from halfmoon.core.errors import EngineError
from halfmoon.core.kv_spec import KVSpec
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.interface import (
    NO_KV,
    Engine,
    EngineStats,
    RequestKV,
    RequestOutput,
    StageChunk,
    StageResult,
    StepTiming,
)
from halfmoon.protocol.sampling import SamplingParams

T = TypeVar("T")
_STOP = object()


class AsyncEngine(Engine):
    """``Engine`` over an LLMEngine built and stepped on one thread of its own.

    Every engine call happens on that thread, between steps, in submission order.
    ``cached_prefix_blocks`` is the one read that does not wait for the step in progress. The stats are
    a snapshot taken on the engine thread after every step and command; ``kv_spec``, ``layout``,
    ``model_name``, ``hidden_size`` and ``dtype`` never change once started. ``call(fn)`` runs
    ``fn(engine)`` on the engine thread: it is this class's own, for tests that need to hold or look
    into the engine, and no part of ``Engine``.
    """

    paces_prompts = True

    def __init__(self, make_engine: Callable[[], LLMEngine],
                 on_step: Callable[[StepTiming], None] | None = None) -> None:
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._on_step = on_step
        self._built = threading.Event()
        self._failure: BaseException | None = None
        self._engine: LLMEngine
        self._stats = EngineStats(0, 0, 0, 0)
        self._kv_spec: KVSpec
        self._layout: BlockLayout
        self._model_name = ""
        self._hidden_size = 0
        self._dtype: torch.dtype = torch.float32
        # NOTE: the engine is built and stepped on this one thread. torch's OpenMP pool belongs to
        # the thread that starts it; a second torch thread in the process halves the first one's speed.
        self._thread = threading.Thread(target=self._run, args=(make_engine,), name="engine", daemon=True)
        self._thread.start()

    @classmethod
    async def start(cls, make_engine: Callable[[], LLMEngine],
                    on_step: Callable[[StepTiming], None] | None = None) -> AsyncEngine:
        """Build the engine on its thread; raises what building raised (a bad model directory)."""
        engine = cls(make_engine, on_step)
        await asyncio.to_thread(engine._built.wait)
        if engine._failure is not None:
            raise engine._failure
        return engine

    # ------------------------------------------------------------ engine thread
    def _run(self, make_engine: Callable[[], LLMEngine]) -> None:
        try:
            self._engine = make_engine()
            self._kv_spec, self._layout, self._model_name = (self._engine.kv_spec, self._engine.layout,
                                                             self._engine.model_name)
            self._hidden_size, self._dtype = self._engine.hidden_size, self._engine.config.torch_dtype
            self._stats = self._engine.stats()
        except BaseException as exc:  # re-raised by start() on the caller's side
            self._failure = exc
            return
        finally:
            self._built.set()
        while True:
            block = not self._engine.has_unfinished()
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                command = None
            while command is not None:
                if command is _STOP:
                    return
                command()
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._engine.has_unfinished():
                self._step()  # takes the stats itself, after the step
            else:
                self._stats = self._engine.stats()

    def _step(self) -> None:
        started = time.perf_counter()
        outputs = self._engine.step()
        self._stats = stats = self._engine.stats()
        if self._on_step is not None:
            decoding = sum(1 for out in outputs if out.num_output_tokens > 1)
            self._on_step(StepTiming(time.time(), time.perf_counter() - started, len(outputs), decoding,
                                     stats.total_blocks - stats.free_blocks, self._engine.last_step_tokens))
        # One wake-up per event loop for the whole step: woken once per output, the loop thread fought this
        # thread for the GIL eight times a step, and the step's tokens left the process spread over
        # milliseconds instead of together.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], RequestOutput]]] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
            if out.finished:
                self._streams.pop(out.request_id, None)
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_each, items)

    # ---------------------------------------------------------------- asyncio
    @property
    def kv_spec(self) -> KVSpec:
        return self._kv_spec

    @property
    def layout(self) -> BlockLayout:
        return self._layout

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def stats(self) -> EngineStats:
        return self._stats

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self._engine)
            except BaseException as exc:  # handed to the awaiting caller
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._commands.put(run)
        return await future

    async def generate(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                       output_token_ids: Seq[int] = (), block_keys: Seq[bytes] = (), tenant_salt: str | None = None,
                       prefill_only: bool = False, kv: RequestKV = NO_KV,
                       step_target_s: float = 0.0) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue[Any] = asyncio.Queue()

        def add() -> None:
            self._streams[request_id] = (loop, stream)
            try:
                self._engine.add_request(request_id, prompt_token_ids, params, output_token_ids=output_token_ids,
                                         block_keys=block_keys, prefill_only=prefill_only, kv=kv,
                                         step_target_s=step_target_s)
            except EngineError as exc:
                self._streams.pop(request_id, None)
                loop.call_soon_threadsafe(stream.put_nowait, exc)

        self._commands.put(add)
        while True:
            item = await stream.get()
            if isinstance(item, EngineError):
                raise item
            yield item
            if item.finished:
                return

    def cached_prefix_blocks(self, block_keys: Seq[bytes]) -> int:
        """Read now on the caller's thread. Going through ``call`` would wait for the step in progress,
        and the request, added after the next step had begun, would wait for that one too. The engine
        uses KV imported from a block on only where its cache's reuse reaches it (scheduler ``_reuse``);
        the rest it computes."""
        # NOTE: each key is one dict membership test, atomic against the engine thread's changes.
        return self._engine.cached_prefix_blocks(block_keys)

    async def take_cache_events(self) -> tuple[list[bytes], list[bytes]]:
        return await self.call(lambda engine: engine.take_cache_events())

    async def cached_block_keys(self) -> list[bytes]:
        return await self.call(lambda engine: engine.cached_block_keys())

    async def release(self, request_id: str) -> None:
        await self.call(lambda engine: engine.release(request_id))

    async def export_kv(self, request_id: str, first_block: int = 0, end_block: int | None = None) -> list[bytearray]:
        return await self.call(lambda engine: engine.export_kv(request_id, first_block, end_block))

    async def run_stage(self, chunk: StageChunk) -> StageResult:
        return await self.call(lambda engine: engine.stages.run(chunk))

    async def stage_payloads(self, request_id: str, layers: range) -> list[bytearray]:
        return await self.call(lambda engine: engine.stages.payloads(request_id, layers))

    async def release_stage(self, request_id: str) -> bool:
        return await self.call(lambda engine: engine.stages.release(request_id))

    async def abort(self, request_id: str) -> bool:
        def abort(engine: LLMEngine) -> bool:
            self._streams.pop(request_id, None)
            try:
                engine.abort(request_id)
            except KeyError:
                return False
            return True

        return await self.call(abort)

    def shutdown(self) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout=10)


def _put_each(items: list[tuple[asyncio.Queue[Any], RequestOutput]]) -> None:
    for stream, item in items:
        stream.put_nowait(item)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
