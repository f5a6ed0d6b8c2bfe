"""vLLM's engine behind Halfmoon's ``Engine`` interface: prefill, decode and aggregated instances on vLLM.

vLLM runs in the service's process as its ``AsyncLLM`` (its engine core and worker are child processes of
it, as in vLLM's own API server), with Halfmoon's KV connector (connectors/vllm.py) loaded into its
workers. That connector is how this engine's KV moves, so ``pool_kv`` is True: it looks the context's
full blocks up in the KVCache pool and loads them into vLLM's paged cache layer by layer, and stores every
full block vLLM computes there as each step ends. The services therefore hand this engine no ``RequestKV``
and store nothing for it; a prefill-to-decode hand-off is the prompt's blocks in the pool, under the
request's own keys, which the decode instance's connector finds there. vLLM's own prefix cache is reported
to the conductor as Halfmoon's engine reports its own: vLLM publishes its KV cache events on a ZMQ socket
private to this instance, which this engine reads and turns into block keys (engine/prefix_cache_keys.py).

vLLM is an optional dependency (``pip install 'halfmoon[vllm]'``): this module is imported only when an
instance runs with ``engine = vllm``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgspec
import torch
import zmq
import zmq.asyncio
from vllm import SamplingParams as VllmSamplingParams
from vllm.config import KVEventsConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase

from halfmoon.core.block_format import BlockLayout
from halfmoon.core.errors import EngineError, InvalidRequestError
from halfmoon.core.kv_spec import KVSpec
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.interface import (
    NO_KV,
    PREFILL_DONE,
    Engine,
    EngineStats,
    RequestKV,
    RequestOutput,
    StageChunk,
    StageResult,
    StepTiming,
)
from halfmoon.engine.loader import model_fingerprint
from halfmoon.engine.prefix_cache_keys import PrefixCacheKeys
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.telemetry.propagation import inject_headers

CONNECTOR = "HalfmoonConnector"
CONNECTOR_MODULE = "halfmoon.connectors.vllm"
KEYS_PARAM = "halfmoon_block_keys"  # kv_transfer_params: the request's full-block keys, hex, for the connector
SALT_PARAM = "halfmoon_tenant_salt"  # kv_transfer_params: the salt of those keys, to key the generated blocks
TRACE_PARAM = "halfmoon_trace"  # kv_transfer_params: the request's trace context, so the connector's spans join it
log = logging.getLogger(__name__)
NOT_HERE = ("vLLM's KV moves through its KV connector, inside its workers (Engine.pool_kv): {what} is "
            "Halfmoon's own engine's")


def kv_spec_of(vllm_config: VllmConfig, block_size: int) -> KVSpec:
    """What vLLM's KV means in Halfmoon's terms; refuses what the pool's format cannot carry."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError("HalfmoonConnector: tensor and pipeline parallelism are not supported yet (each worker "
                         "would hold a slice of the heads or layers of every block)")
    if vllm_config.cache_config.cache_dtype != "auto":
        raise ValueError(f"HalfmoonConnector: kv cache dtype {vllm_config.cache_config.cache_dtype} is not a "
                         "Halfmoon block format; use the model's dtype (--kv-cache-dtype auto)")
    if model.use_mla:
        raise ValueError("HalfmoonConnector: MLA caches are not Halfmoon blocks (K and V per head)")
    directory = Path(model.model)
    if not (directory / "config.json").is_file():
        raise ValueError(f"HalfmoonConnector: the model fingerprint needs a local model directory, got {model.model!r}")
    dtype: torch.dtype = model.dtype
    return KVSpec(model_fingerprint=model_fingerprint(directory, dtype).hex(), block_size=block_size,
                  dtype=str(dtype).removeprefix("torch."), num_layers=model.get_num_layers(parallel),
                  num_kv_heads=model.get_num_kv_heads(parallel), head_dim=model.get_head_size())


SET_BY = {"model": "HALFMOON_MODEL_DIR", "dtype": "HALFMOON_DTYPE", "kv_cache_memory_bytes": "HALFMOON_KV_CACHE_BYTES",
          "max_num_seqs": "HALFMOON_MAX_NUM_SEQS", "max_num_batched_tokens": "HALFMOON_MAX_NUM_BATCHED_TOKENS",
          "max_model_len": "HALFMOON_MAX_MODEL_LEN", "kv_transfer_config": "HALFMOON_BLOCK_SIZE and the pool's",
          "kv_events_config": "Halfmoon itself (the conductor's index of vLLM's prefix cache)"}


def engine_args(config: EngineConfig, nats_role: str, connection: Mapping[str, str], events: str,
                extra: Mapping[str, Any] = MappingProxyType({})) -> AsyncEngineArgs:
    """vLLM's arguments for ``config``: the same model, dtype (``auto`` decided as Halfmoon decides it, so
    both engines of one cluster write one block format), KV bytes and batch limits, with Halfmoon's connector
    on the pool's block size, connecting to NATS as ``nats_role``. ``connection``: the connector's settings
    that are not secret (vLLM logs its configuration); credentials and the cluster secret reach vLLM's child
    processes as the service's own HALFMOON_* environment. ``events``: the ZMQ endpoint vLLM publishes its KV
    cache events on. ``extra``: more of vLLM's arguments, none of those set here."""
    pool: dict[str, Any] = {"block_size": config.block_size, "nats_role": nats_role, "exit_with_parent": True,
                            **connection}
    own: dict[str, Any] = dict(
        model=config.model, dtype=config.resolved_dtype, kv_cache_memory_bytes=config.kv_cache_bytes,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_model_len),
        # vLLM's own stat loggers off (they log every step's details); the step recorder still gets them
        max_model_len=config.max_model_len or None, enable_logging_iteration_details=True, disable_log_stats=True,
        kv_transfer_config=KVTransferConfig(kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE,
                                            kv_role="kv_both", kv_load_failure_policy="recompute",
                                            kv_connector_extra_config=pool),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=events))
    taken = sorted(set(extra) & set(own))
    if taken:
        instead = ", ".join(f"{name}: {SET_BY.get(name, 'Halfmoon itself')}" for name in taken)
        raise ValueError(f"vLLM arguments {taken} come from Halfmoon's own settings ({instead})")
    unknown = sorted(set(extra) - {f.name for f in dataclasses.fields(AsyncEngineArgs)})
    if unknown:
        raise ValueError(f"{unknown} are not vLLM engine arguments (AsyncEngineArgs)")
    return AsyncEngineArgs(**own, **extra)


def vllm_sampling(params: SamplingParams, produced: int, prefill_only: bool, keys: Seq[bytes],
                  tenant_salt: str | None = None, trace: Mapping[str, str] = MappingProxyType({})) -> VllmSamplingParams:
    """vLLM's sampling parameters for the rest of a request that has ``produced`` output tokens already;
    ``keys``, the ``tenant_salt`` they were made with and ``trace`` (W3C trace-context headers) go to the
    connector."""
    remaining = params.max_tokens - produced
    if remaining < 1:
        raise InvalidRequestError(f"max_tokens {params.max_tokens} leaves nothing after {produced} output tokens")
    return VllmSamplingParams(
        n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=params.seed, stop=list(params.stop) or None, stop_token_ids=list(params.stop_token_ids) or None,
        ignore_eos=params.ignore_eos, max_tokens=1 if prefill_only else remaining,
        logprobs=0 if params.logprobs else None, output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": {KEYS_PARAM: [key.hex() for key in keys], SALT_PARAM: tenant_salt,
                                           TRACE_PARAM: dict(trace)}})


class _StepRecorder(StatLoggerBase):
    """vLLM's per-iteration statistics, handed to ``sink``: AsyncLLM's output handler calls ``record`` on the
    event loop once per engine step's outputs."""

    def __init__(self, vllm_config: VllmConfig, engine_index: int, sink: Callable[[Any, Any], None]) -> None:
        self.sink = sink

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.sink(scheduler_stats, iteration_stats)

    def log_engine_initialized(self) -> None:
        return None


class VllmEngine(Engine):
    """``Engine`` over vLLM's ``AsyncLLM`` in this process.

    What it does not do, it refuses with an EngineError rather than pretending: KV handed in or out by
    the service (``pool_kv``: the connector moves it) and pipeline stages (CPP). Its local prefix cache is
    vLLM's, reported from vLLM's KV cache events."""

    pool_kv = True
    _llm: AsyncLLM
    _kv_spec: KVSpec
    _layout: BlockLayout

    def __init__(self, config: EngineConfig, on_step: Callable[[StepTiming], None] | None) -> None:
        self._config = config
        self._on_step = on_step
        self._model_name = Path(config.model).name
        self._stats = EngineStats(0, 0, 0, 0)
        self._active: set[str] = set()
        self._total_blocks = 0
        self._vllm_block_size = config.block_size
        # every step so far: seconds and tokens computed (a request's compute_s is its share by tokens)
        self._step_seconds = 0.0
        self._step_tokens = 0
        self._events_dir = tempfile.mkdtemp(prefix="halfmoon-vllm-")
        self._events: zmq.asyncio.Socket | None = None
        self._events_task: asyncio.Task[None] | None = None
        self._prefix_cache: PrefixCacheKeys | None = None

    @classmethod
    async def start(cls, config: EngineConfig, nats_role: str, connection: Mapping[str, str],
                    extra_args: Mapping[str, Any], on_step: Callable[[StepTiming], None] | None = None) -> VllmEngine:
        engine = cls(config, on_step)

        def recorder(vllm_config: VllmConfig, engine_index: int) -> StatLoggerBase:
            return _StepRecorder(vllm_config, engine_index, engine._record)

        # vLLM on a CPU keeps one core per worker for its scheduler process, and one more when a KV connector
        # is configured (for NIXL's transfer threads). On 2 cores that second reservation leaves none, so the
        # worker's OpenMP threads took both cores, beside the scheduler and the load generator: decode steps
        # 1.45x vLLM alone's (BENCHMARKS, "Where does halfmoon up --engine vllm lose to vLLM alone?"). This
        # connector's reads need no core of their own: reserve what vLLM reserves without a connector.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        endpoint = f"ipc://{engine._events_dir}/kv-events"
        # subscribed before vLLM binds it, so no event is missed
        engine._events = zmq.asyncio.Context.instance().socket(zmq.SUB)
        engine._events.setsockopt(zmq.SUBSCRIBE, b"")
        engine._events.connect(endpoint)
        # NOTE: it builds vLLM's engine core process and its worker, and profiles them: minutes on a CPU
        engine._llm = llm = AsyncLLM.from_engine_args(engine_args(config, nats_role, connection, endpoint, extra_args),
                                                      stat_loggers=[recorder])
        vllm_config = llm.vllm_config
        engine._kv_spec = kv_spec_of(vllm_config, config.block_size)
        engine._prefix_cache = PrefixCacheKeys(engine._kv_spec.hasher)
        engine._events_task = asyncio.create_task(engine._read_cache_events(engine._events, engine._prefix_cache))
        engine._layout = BlockLayout.of(engine._kv_spec)
        engine._total_blocks = vllm_config.cache_config.num_gpu_blocks or 0
        engine._vllm_block_size = vllm_config.cache_config.block_size
        total = engine._pool_blocks(engine._total_blocks)
        engine._stats = EngineStats(0, 0, total, total)
        return engine

    @staticmethod
    async def _read_cache_events(socket: zmq.asyncio.Socket, cache: PrefixCacheKeys) -> None:
        """vLLM's KV cache events, as they come (each message: topic, sequence number, a msgpack batch)."""
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        while True:
            *_, payload = await socket.recv_multipart()
            try:
                batch = decoder.decode(payload)
            except msgspec.DecodeError as exc:  # another vLLM's format: the index misses these blocks, no more
                log.warning("vLLM KV cache event not understood: %s", exc)
                continue
            for event in batch.events:
                if isinstance(event, BlockStored):
                    cache.stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                                 event.extra_keys)
                elif isinstance(event, BlockRemoved):
                    cache.removed(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    cache.cleared()

    def _record(self, scheduler: Any, iteration: Any) -> None:
        usage = float(getattr(scheduler, "kv_cache_usage", 0.0))
        used = round(usage * self._total_blocks)
        self._stats = EngineStats(scheduler.num_running_reqs, scheduler.num_waiting_reqs,
                                  self._pool_blocks(self._total_blocks - used), self._pool_blocks(self._total_blocks))
        details = getattr(scheduler, "iteration_details", None)
        if details is None or details.is_dummy:
            return
        self._step_seconds += details.elapsed_ms / 1000
        self._step_tokens += details.num_ctx_tokens + details.num_generation_tokens
        if self._on_step is None:
            return
        decoding = details.num_generation_requests
        outputs = decoding + (len(iteration.time_to_first_tokens_iter) if iteration is not None else 0)
        self._on_step(StepTiming(ended=time.time(), seconds=details.elapsed_ms / 1000, num_outputs=outputs,
                                 num_decoding=decoding, kv_blocks=self._pool_blocks(used),
                                 num_tokens=details.num_ctx_tokens + details.num_generation_tokens))

    def _pool_blocks(self, vllm_blocks: int) -> int:
        """vLLM's blocks as the pool-sized blocks Halfmoon counts (stats, step timings, the conductor's KV
        capacity), by the tokens they hold."""
        return vllm_blocks * self._vllm_block_size // self._config.block_size

    @property
    def kv_spec(self) -> KVSpec:
        return self._kv_spec

    @property
    def layout(self) -> BlockLayout:
        return self._layout

    @property
    def model_name(self) -> str:
        return self._model_name

    def stats(self) -> EngineStats:
        return self._stats

    async def generate(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                       output_token_ids: Seq[int] = (), block_keys: Seq[bytes] = (), tenant_salt: str | None = None,
                       prefill_only: bool = False, kv: RequestKV = NO_KV,
                       step_target_s: float = 0.0) -> AsyncIterator[RequestOutput]:
        """``block_keys`` are the keys of the whole context's full blocks (prompt and ``output_token_ids``):
        the connector loads and stores the pool's blocks under them, and vLLM's own prefix cache is salted
        with the first, so it shares blocks only where the pool would (same tenant, same first block). vLLM
        schedules its own steps: ``step_target_s`` is not honoured (``paces_prompts`` is False)."""
        if kv.has_source or kv.sink is not None or kv.export_prompt_from is not None:
            raise InvalidRequestError(NOT_HERE.format(what="a RequestKV"))
        if not prompt_token_ids:
            raise InvalidRequestError("a request needs at least one prompt token")
        if request_id in self._active:
            raise InvalidRequestError(f"request {request_id} is already running")
        context = [*prompt_token_ids, *output_token_ids]
        sampling = vllm_sampling(params, len(output_token_ids), prefill_only, block_keys, tenant_salt, inject_headers())
        prompt = TokensPrompt(prompt_token_ids=context)
        if block_keys:
            prompt["cache_salt"] = block_keys[0].hex()
            assert self._prefix_cache is not None
            self._prefix_cache.expect(block_keys[0], tenant_salt)
        produced = len(output_token_ids)
        started = time.perf_counter()
        since = (self._step_seconds, self._step_tokens)
        self._active.add(request_id)
        try:
            async for out in self._llm.generate(prompt, sampling, request_id):
                completion = out.outputs[0]
                tokens = list(completion.token_ids)
                produced += len(tokens)
                logprobs = ([entries[token].logprob for token, entries in zip(tokens, completion.logprobs)]
                            if params.logprobs and completion.logprobs else [])
                reason = completion.finish_reason if out.finished else None
                if prefill_only and reason == "length" and produced < params.max_tokens:
                    reason = PREFILL_DONE
                yield RequestOutput(request_id=request_id, new_token_ids=tokens, new_logprobs=logprobs,
                                    text_delta=completion.text, finished=out.finished, finish_reason=reason,
                                    num_prompt_tokens=len(prompt_token_ids),
                                    num_cached_tokens=min(out.num_cached_tokens or 0, len(context)),
                                    num_output_tokens=produced,
                                    compute_s=self._compute_share(since, len(context) - (out.num_cached_tokens or 0)
                                                                  + produced - len(output_token_ids) - 1, started))
        except asyncio.CancelledError:
            await self._llm.abort(request_id)
            raise
        except ValueError as exc:  # vLLM's refusal of the request (too long, a bad parameter)
            raise InvalidRequestError(f"vLLM refused request {request_id}: {exc}") from exc
        finally:
            self._active.discard(request_id)

    def _compute_share(self, since: tuple[float, int], tokens: int, started: float) -> float:
        """A request's share of the steps since ``since`` (its first), by the ``tokens`` it computed in them,
        as Halfmoon's engine counts it: steps batch requests, so the time until its output would charge it
        with every other request's tokens. Before vLLM reports a step, the time since ``started``."""
        seconds, step_tokens = self._step_seconds - since[0], self._step_tokens - since[1]
        if step_tokens <= 0:
            return time.perf_counter() - started
        return seconds * min(1.0, max(tokens, 1) / step_tokens)

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._active:
            return False
        await self._llm.abort(request_id)
        return True

    async def release(self, request_id: str) -> None:
        raise EngineError(NOT_HERE.format(what="keeping a prefill's KV for its hand-off"))

    async def export_kv(self, request_id: str, first_block: int = 0, end_block: int | None = None) -> list[bytearray]:
        raise EngineError(NOT_HERE.format(what="exporting a request's KV"))

    def cached_prefix_blocks(self, block_keys: Seq[bytes]) -> int:
        return 0

    async def take_cache_events(self) -> tuple[list[bytes], list[bytes]]:
        return self._prefix_cache.take() if self._prefix_cache is not None else ([], [])

    async def cached_block_keys(self) -> list[bytes]:
        return self._prefix_cache.held() if self._prefix_cache is not None else []

    @property
    def hidden_size(self) -> int:
        return int(self._llm.vllm_config.model_config.get_hidden_size())

    @property
    def dtype(self) -> torch.dtype:
        return self._llm.vllm_config.model_config.dtype

    async def run_stage(self, chunk: StageChunk) -> StageResult:
        raise EngineError("vLLM's engine runs no pipeline stages (chunked pipeline-parallel prefill): "
                          "leave HALFMOON_CPP_STAGES at 1 with HALFMOON_ENGINE=vllm")

    async def stage_payloads(self, request_id: str, layers: range) -> list[bytearray]:
        raise EngineError("vLLM's engine runs no pipeline stages")

    async def release_stage(self, request_id: str) -> bool:
        return False

    def shutdown(self) -> None:
        if self._events_task is not None:
            self._events_task.cancel()
        self._llm.shutdown()
        if self._events is not None:
            self._events.close(linger=0)
        with contextlib.suppress(OSError):
            shutil.rmtree(self._events_dir)
