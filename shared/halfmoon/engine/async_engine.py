"""Drive an LLMEngine from asyncio: the engine steps in its own thread, callers await streams."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from typing import Any, NamedTuple, TypeVar

import torch

from halfmoon.core.block_format import BlockLayout
from halfmoon.core.errors import EngineError
from halfmoon.core.kv_spec import KVSpec
from halfmoon.engine.engine import EngineStats, LLMEngine, RequestOutput
from halfmoon.engine.stage import StageChunk, StageResult
from halfmoon.protocol.sampling import SamplingParams

T = TypeVar("T")
_STOP = object()


class StepTiming(NamedTuple):
    """One engine step: when it ended, how long it took, how many sequences it advanced, how many of
    those were decoding (past their first token), how many KV blocks were in use after it, and how many
    tokens it computed (more than ``num_decoding``: prompt tokens shared the step)."""

    ended: float
    seconds: float
    num_outputs: int
    num_decoding: int = 0
    kv_blocks: int = 0
    num_tokens: int = 0

    @property
    def shared_with_prefill(self) -> bool:
        return self.num_tokens > self.num_decoding


class AsyncEngine:
    """Contract: every engine call happens on the engine thread, in submission order.

    ``generate`` yields the request's RequestOutputs as steps produce them and ends after
    the finished one; an engine error while adding surfaces from the first ``anext``. A
    caller that stops iterating early must ``abort``. ``call(fn)`` runs ``fn(engine)`` on
    the engine thread between steps (KV export, release). ``cached_prefix_blocks`` is the one read
    that does not wait for the step in progress. ``stats()``, ``kv_spec``, ``layout`` and
    ``model_name`` may be read from any thread: the stats are a snapshot taken on the engine
    thread after every step and command, the rest never change. ``run_stage``, ``stage_payloads`` and
    ``release_stage`` run one pipeline stage of a request (engine/stage.py) between steps.
    """

    def __init__(self, make_engine: Callable[[], LLMEngine],
                 on_step: Callable[[StepTiming], None] | None = None) -> None:
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._on_step = on_step
        self._built = threading.Event()
        self._failure: BaseException | None = None
        self._engine: LLMEngine
        self._stats = EngineStats(0, 0, 0, 0)
        self.kv_spec: KVSpec
        self.layout: BlockLayout
        self.model_name = ""
        self.hidden_size = 0
        self.dtype: torch.dtype = torch.float32
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
            self.kv_spec, self.layout, self.model_name = (self._engine.kv_spec, self._engine.layout,
                                                          self._engine.model_name)
            self.hidden_size, self.dtype = self._engine.hidden_size, self._engine.config.torch_dtype
            self._stats = self._engine.stats()
        except BaseException as exc:  # noqa: BLE001 - re-raised by start() on the caller's side
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
        for out in outputs:
            self._deliver(out.request_id, out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _deliver(self, request_id: str, item: Any) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    # ---------------------------------------------------------------- asyncio
    def stats(self) -> EngineStats:
        return self._stats

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self._engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._commands.put(run)
        return await future

    async def generate(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                       **options: Any) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue[Any] = asyncio.Queue()

        def add() -> None:
            self._streams[request_id] = (loop, stream)
            try:
                self._engine.add_request(request_id, prompt_token_ids, params, **options)
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
        """How many leading blocks of ``block_keys`` the local prefix cache holds, read now on the caller's
        thread. Going through ``call`` would wait for the step in progress, and the request, added after
        the next step had begun, would wait for that one too. The answer is a hint: the engine reuses
        only what its cache still holds when it schedules the request, and uses KV imported from a block
        on only where that reuse reaches it (scheduler ``_reuse``); the rest it computes."""
        # NOTE: each key is one dict membership test, atomic against the engine thread's changes.
        return self._engine.cached_prefix_blocks(block_keys)

    async def run_stage(self, chunk: StageChunk) -> StageResult:
        """Run one chunk of a request through a range of layers (a pipeline stage); EngineError when refused."""
        return await self.call(lambda engine: engine.stages.run(chunk))

    async def stage_payloads(self, request_id: str, layers: range) -> list[bytearray]:
        """The stage's layers of every block the request computed here, in pool format (unsealed)."""
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


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
