"""What prefill and decode instances share: the engine settings, the engine thread, load figures,
and the directory of transfer nodes they move KV through."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from abc import abstractmethod
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import nats
from opentelemetry.trace import TracerProvider

from halfmoon.core.kv_spec import KVSpec
from halfmoon.engine import native
from halfmoon.engine.async_engine import AsyncEngine
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.host_memory import HostMemory
from halfmoon.engine.interface import Engine, StepTiming
from halfmoon.policy.state import SERVING_SLO
from halfmoon.protocol import codecs
from halfmoon.protocol.base import Ack, Codec, ErrorCode, ErrorReply, Message
from halfmoon.protocol.registry import KernelReport, Load, Role
from halfmoon.protocol.stream import ErrorEvent, ResumeRequest, TokenEvent
from halfmoon.protocol.work import CancelRequest, WorkDone, WorkOutcome
from halfmoon.runtime.base import Service
from halfmoon.runtime.data_plane import DataPlaneConfig, OneSidedEndpoints
from halfmoon.runtime.handoff import KVHandOff
from halfmoon.runtime.load_meter import LoadMeter
from halfmoon.runtime.memory import MemoryReport, engine_report
from halfmoon.runtime.pool_client import PoolClient
from halfmoon.runtime.replay import ReplayBuffer
from halfmoon.runtime.transfer_nodes import TransferDirectory
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.client import TransferClient

ENGINES = ("halfmoon", "vllm")


@dataclass(frozen=True)
class WorkerConfig(DataPlaneConfig):
    """A model-serving instance: which model, how its engine is shaped, which transfer node to use."""

    model_dir: str = field(default="", metadata={"help": "local model directory (required)"})
    engine: str = field(default="halfmoon", metadata={
        "help": "halfmoon (this package's engine) or vllm (vLLM's engine with Halfmoon's KV connector; "
                "pip install 'halfmoon[vllm]')"})
    vllm_args: str = field(default="", metadata={
        "help": "with engine vllm: more of vLLM's engine arguments, a JSON object of AsyncEngineArgs fields "
                "(e.g. {\"enforce_eager\": true}); those Halfmoon sets from its own settings are refused"})
    dtype: str = field(default="auto", metadata={
        "help": "auto (bfloat16 where the CPU has AVX512-BF16/AMX or the GPU computes it natively, else float32), "
                "float32, bfloat16 or float16"})
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda[:N]"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block (all instances must agree)"})
    kv_cache_bytes: int = field(default=1 << 30, metadata={"help": "bytes of paged KV cache"})
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in one batch"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "token budget per engine step"})
    prefill_chunk_size: int = field(default=512, metadata={"help": "most prompt tokens one sequence computes per step"})
    tbt_slo_s: float = field(default=SERVING_SLO.tbt_s, metadata={
        "help": "TBT SLO the steps are sized to with tbt_chunking (HALFMOON_TBT_SLO_S sets this and the "
                "conductor's at once)"})
    tbt_chunking: bool = field(default=False, metadata={
        "help": "while sequences decode, give each step only the prompt tokens that fit in tbt_slo_s after "
                "them: bounded worst gaps, a median gap near the SLO, slower prompts (docs/BENCHMARKS.md)"})
    max_model_len: int = field(default=0, metadata={"help": "context limit (0: the model's own)"})
    transfer_instance: str = field(default="", metadata={"help": "prefer this transfer node (default: any live one)"})
    local_prefix_cache: bool = field(default=True, metadata={"help": "keep computed blocks in the engine for reuse"})
    layerwise_handoff: bool = field(default=True, metadata={
        "help": "prefill ships each layer's KV as it is computed (else all layers after the last one)"})
    layerwise_prefix: bool = field(default=True, metadata={
        "help": "a prefix cached in the pool loads layer by layer while the new tokens compute, where its "
                "nodes move byte ranges (else it is read whole first)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model_dir:
            raise ValueError("a model directory is required (--model-dir or HALFMOON_MODEL_DIR)")
        if self.engine not in ENGINES:
            raise ValueError(f"HALFMOON_ENGINE (engine) is {self.engine!r}: one of {', '.join(ENGINES)}")
        if self.vllm_args and self.engine != "vllm":
            raise ValueError("HALFMOON_VLLM_ARGS are vLLM's engine arguments: set HALFMOON_ENGINE=vllm too")
        if self.vllm_args:
            self.extra_vllm_args()
        if self.engine == "vllm" and self.tbt_chunking:
            raise ValueError("HALFMOON_TBT_CHUNKING sizes Halfmoon's engine's steps; vLLM schedules its own "
                             "(HALFMOON_ENGINE=vllm): turn one of them off")
        if self.tbt_chunking and not (math.isfinite(self.tbt_slo_s) and self.tbt_slo_s > 0):
            raise ValueError(f"HALFMOON_TBT_CHUNKING (tbt_chunking) sizes steps to the TBT SLO, but "
                             f"HALFMOON_TBT_SLO_S (tbt_slo_s) is {self.tbt_slo_s}: set a positive SLO "
                             f"(default {SERVING_SLO.tbt_s}) or turn chunking off")
        self.engine_config()  # validates the engine settings now, not at first use

    def extra_vllm_args(self) -> dict[str, Any]:
        try:
            extra = json.loads(self.vllm_args or "{}")
        except ValueError as exc:
            raise ValueError(f"HALFMOON_VLLM_ARGS (vllm_args) is not JSON: {exc}") from exc
        if not isinstance(extra, dict):
            raise ValueError("HALFMOON_VLLM_ARGS (vllm_args) is a JSON object of vLLM engine arguments")
        return extra

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model_dir, dtype=self.dtype, device=self.device, block_size=self.block_size,
            kv_cache_bytes=self.kv_cache_bytes, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, prefill_chunk_size=self.prefill_chunk_size,
            max_model_len=self.max_model_len, step_time_target_s=self.tbt_slo_s if self.tbt_chunking else 0.0,
        )


class EngineWorker(Service[WorkerConfig]):
    """Base of prefill and decode: owns the engine thread and the requests in flight.

    Contract for subclasses: ``submit_subject`` names where work arrives (a pattern), ``issuer`` which
    gateway a request came from, and ``accept`` validates one decoded request and returns the coroutine
    that serves it; the base acks, runs it as a task keyed by request id, cancels it on CancelRequest,
    refuses new work while draining and waits for the tasks on drain. A newer attempt of a request that
    is still here (it migrated away and back) replaces the older one, when it streams to the same place.
    Stream events go out through ``publish_event``, which keeps the recent ones for ``ResumeRequest``.
    How each request's work ends here goes out as WorkDone, for the conductors' ledgers of placed work.
    """

    config_class = WorkerConfig
    submit_codec: ClassVar[Codec[Any]]
    endpoints: OneSidedEndpoints  # these four from ``start``
    transfer: TransferClient
    pool: PoolClient
    handoff: KVHandOff

    def __init__(self, config: WorkerConfig, tracer_provider: TracerProvider | None = None) -> None:
        super().__init__(config, tracer_provider)
        self.meter = LoadMeter(config.block_size)
        self.transfer_nodes = TransferDirectory(config.transfer_instance)
        self.engine: Engine | None = None
        self._kernels: KernelReport | None = None
        self._memory: HostMemory | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._attempts: dict[str, int] = {}  # the attempt each task in ``_tasks`` serves
        self._streams: dict[str, str] = {}  # the stream subject each task in ``_tasks`` publishes on
        self.replay = ReplayBuffer()
        self._busy: set[str] = set()  # requests whose engine work is not done (reported as load)
        self._failed: set[str] = set()  # requests here that an error event ended
        self._reported: dict[str, WorkOutcome] = {}  # the WorkDone sent for requests still here
        self._reporting: set[asyncio.Task[None]] = set()
        self._accepted = 0
        self._tbt = METRICS.tbt.labels(self.instance_id)

    @property
    def address(self) -> str:
        return self.submit_subject

    @property
    def model(self) -> str:
        return self.engine.model_name if self.engine else ""

    @property
    def kv_spec(self) -> KVSpec | None:
        return self.engine.kv_spec if self.engine else None

    @property
    def kernels(self) -> KernelReport | None:
        return self._kernels

    @property
    def paces_prompts(self) -> bool:
        return self.engine is not None and self.engine.paces_prompts

    @property
    @abstractmethod
    def submit_subject(self) -> str: ...

    @abstractmethod
    def issuer(self, request: Any, subject: str) -> str:
        """The gateway that issued ``request``, which arrived on ``subject``: its events stream to
        ``Subjects.stream(issuer, request_id)``. Whatever names it must be vouched for by the NATS permissions
        of those who may send here, so a forged request cannot aim this instance's output at another stream."""

    @abstractmethod
    def accept(self, request: Any, gateway: str) -> Coroutine[Any, Any, None]: ...

    def memory_report(self) -> MemoryReport:
        memory = self._memory
        if memory is None:  # not started: no engine yet
            return super().memory_report()
        return engine_report(self.role.value, weights_bytes=memory.weights, kv_cache_bytes=memory.kv_cache,
                             working_bytes=memory.step, block_bytes=memory.block_bytes)

    def load(self) -> Load:
        return self.meter.load(self.engine.stats(), len(self._busy), self._accepted) if self.engine else Load()

    def heartbeat_load(self) -> Load:
        steps, shared_steps = self.meter.take_steps()
        return msgspec.structs.replace(self.load(), steps=steps, shared_steps=shared_steps)

    async def start(self) -> None:
        config = self.config.engine_config()
        if self.config.engine == "vllm":
            try:
                from halfmoon.engine.vllm_engine import VllmEngine
            except ImportError as exc:
                raise RuntimeError(f"HALFMOON_ENGINE=vllm, but vLLM does not import here ({exc}): pip install "
                                   "'halfmoon[vllm]'; an image: build it with HALFMOON_EXTRAS=vllm "
                                   "(infra/compose.vllm.yml)") from exc
            connection = {"nats_url": self.config.nats_url, "namespace": self.config.namespace}
            self.engine = await VllmEngine.start(config, self.role.value, connection, self.config.extra_vllm_args(),
                                                 self._on_step)
        else:
            self.engine = engine = await AsyncEngine.start(lambda: LLMEngine(config), self._on_step)
            self._memory = await engine.call(LLMEngine.host_memory)
            # NOTE: after the engine is built: its kernels are loaded (or not) by then, and report() reads that
            self._kernels = kernels = native.report(config.torch_device.type)
            METRICS.engine_kernels.labels(self.instance_id, kernels.kind, kernels.isa, kernels.reason).set(1)
            self.log.info("engine kernels", extra={"kernels": str(kernels)})
        layout = self.engine.layout.keyed(self.cluster_keys.kv_mac)  # seals and verifies the pool's blocks
        self.endpoints = OneSidedEndpoints(self.config)
        self.transfer = self.endpoints.client(self.cluster_keys)
        self.pool = PoolClient(self, self.transfer, layout)
        self.handoff = KVHandOff(self.pool, self.transfer, self.transfer_nodes, layout, self.tracer, self.log,
                                 self.cluster_keys.park)
        await self.listen_heartbeats(self.transfer_nodes.on_heartbeat)
        await self.listen_downs(self.transfer_nodes.on_down)
        await self.listen(self.subjects.cancel, codecs.CANCEL, self._on_cancel)
        await self.serve(self.subjects.resume(self.instance_id), codecs.RESUME, self._on_resume,
                         span_name=f"{self.role.value}.resume")
        await self.serve_addressed(self.submit_subject, self.submit_codec, self._on_submit,
                                   span_name=f"{self.role.value}.submit")

    def _on_step(self, timing: StepTiming) -> None:
        """Runs on the engine thread after every step."""
        self.meter.on_step(timing)
        if timing.num_outputs and self.role in (Role.DECODE, Role.AGGREGATED):
            self._tbt.observe(timing.seconds)

    async def _on_submit(self, request: Any, subject: str) -> Message:
        if self.draining:
            return ErrorReply(code=ErrorCode.UNAVAILABLE, message=f"{self.instance_id} is draining", retryable=True)
        rid, gateway = request.request_id, self.issuer(request, subject)
        stream = self.subjects.stream(gateway, rid)
        if rid in self._tasks:
            # NOTE: only the request's own gateway moves it on: another's submit under its id ends nothing
            if self._attempts[rid] >= request.attempt or self._streams[rid] != stream:
                return ErrorReply(code=ErrorCode.BAD_REQUEST, message=f"request {rid} already here")
            self._tasks[rid].cancel()  # superseded: the requester moved on to a newer attempt
        task = asyncio.create_task(self._guarded(request, gateway))
        self._busy.add(rid)
        self._failed.discard(rid)
        self._reported.pop(rid, None)
        self._accepted += 1
        self._tasks[rid], self._attempts[rid] = task, request.attempt
        self._streams[rid] = stream
        task.add_done_callback(functools.partial(self._forget, rid))
        return Ack(request_id=rid, instance_id=self.instance_id, incarnation=self.incarnation)

    def _forget(self, request_id: str, task: asyncio.Task[None]) -> None:
        # NOTE: a task cancelled before its first step never runs ``_guarded``'s body, so only a
        # done callback sees every ending; the request leaves the load figures here whatever happened.
        if self._tasks.get(request_id) is task:
            outcome = (WorkOutcome.CANCELLED if task.cancelled()
                       else WorkOutcome.FAILED if request_id in self._failed else WorkOutcome.COMPLETED)
            self._report(request_id, outcome)
            del self._tasks[request_id], self._attempts[request_id], self._streams[request_id]
            self._busy.discard(request_id)
            self._failed.discard(request_id)
            self._reported.pop(request_id, None)

    async def _guarded(self, request: Any, gateway: str) -> None:
        """Run one request; a bug fails that request with an error event, never silently."""
        try:
            await self.accept(request, gateway)
        except Exception as exc:  # reported to the requester and logged
            self.log.exception("request failed", extra={"request_id": request.request_id})
            await self.send_error(self.subjects.stream(gateway, request.request_id), request.request_id,
                                  ErrorCode.INTERNAL,
                                  f"{self.instance_id}: {type(exc).__name__}: {exc}", request.attempt)
        self.done_computing(request.request_id)

    def begin_computing(self, request_id: str) -> None:
        """Engine work that came otherwise than by submit (a pipeline stage's chunks) is load until
        ``done_computing``."""
        self._busy.add(request_id)
        self._reported.pop(request_id, None)

    def done_computing(self, request_id: str, failed: bool = False) -> None:
        """The engine's part of a request is over (prefill calls it before the hand-off)."""
        if request_id in self._busy:
            self._busy.discard(request_id)
            failed = failed or request_id in self._failed
            self._report(request_id, WorkOutcome.FAILED if failed else WorkOutcome.COMPLETED)
            if request_id not in self._tasks:
                self._reported.pop(request_id, None)  # no task whose end reports again

    def record_ttft(self, seconds: float) -> None:
        """A request's first token took ``seconds`` here (its load estimate, and the TTFT metric)."""
        self.meter.on_first_token(seconds)
        METRICS.ttft.labels(self.instance_id).observe(seconds)

    def report_prefilled(self, request_id: str) -> None:
        """An instance doing both parts of a request tells the conductors its prefill part is over (its
        ``WorkDone`` at the end reports the decode part)."""
        self._send_done(request_id, WorkOutcome.COMPLETED)

    def _report(self, request_id: str, outcome: WorkOutcome) -> None:
        """Publish WorkDone once per request, and again when a completed part turns into a failure later
        (a prefill whose hand-off failed: the decode placed for it will never run)."""
        prior = self._reported.get(request_id)
        if prior is outcome or prior in (WorkOutcome.FAILED, WorkOutcome.CANCELLED):
            return
        self._reported[request_id] = outcome
        self._send_done(request_id, outcome)

    def _send_done(self, request_id: str, outcome: WorkOutcome) -> None:
        done = WorkDone(request_id=request_id, instance_id=self.instance_id, outcome=outcome,
                        attempt=self._attempts.get(request_id, 0))
        task = asyncio.get_running_loop().create_task(self._publish_done(done))
        self._reporting.add(task)
        task.add_done_callback(self._reporting.discard)

    async def _publish_done(self, done: WorkDone) -> None:
        try:
            await self.publish(self.subjects.work_done_from(self.role.value), done)
        except nats.errors.Error as exc:  # the conductors' heartbeat reconciliation frees the work instead
            self.log.warning("work done not sent", extra={"request_id": done.request_id, "error": str(exc)})

    async def _on_cancel(self, cancel: CancelRequest, _headers: Mapping[str, str]) -> None:
        rid = cancel.request_id
        task = self._tasks.get(rid)
        if task is None or cancel.attempt not in (None, self._attempts[rid]):
            return
        attempt, subject = self._attempts[rid], self._streams[rid]
        task.cancel()
        # NOTE: a cancelled task streams nothing more; said on the stream, a requester still following this
        # attempt (it did not send the cancel) moves on now instead of after its token timeout. The requester
        # that did send it has left the stream or the attempt, and drops the event.
        await self.publish_event(subject, ErrorEvent(request_id=rid, code=ErrorCode.CANCELLED,
                                                     message=f"{self.instance_id} cancelled attempt {attempt}"
                                                             + (f": {cancel.reason}" if cancel.reason else ""),
                                                     instance_id=self.instance_id, attempt=attempt))

    async def _on_resume(self, resume: ResumeRequest) -> Message:
        """Re-send the recent events of an attempt; an error when this instance cannot."""
        rid = resume.request_id
        found = self.replay.since(rid, resume.attempt, resume.from_index)
        working = self._attempts.get(rid) == resume.attempt
        if found is None and not working:
            return ErrorReply(code=ErrorCode.UNAVAILABLE, message=f"{self.instance_id} holds no events of {rid} "
                              f"attempt {resume.attempt} from index {resume.from_index}")
        if found is not None:
            subject, events = found
            METRICS.stream_resends.inc(len(events))
            for event in events:
                await self.publish(subject, event)
        return Ack(request_id=rid, instance_id=self.instance_id, incarnation=self.incarnation)

    async def publish_event(self, subject: str, event: TokenEvent | ErrorEvent) -> None:
        """Publish one stream event and keep it for re-sending."""
        self.replay.record(subject, event, time.monotonic())
        await self.publish(subject, event)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await asyncio.sleep(0)  # the tasks' done callbacks queue the last WorkDone notes; send them before goodbye
        if self._reporting:
            await asyncio.gather(*self._reporting, return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if hasattr(self, "transfer"):
            await self.transfer.close()
            self.endpoints.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)

    async def send_error(self, subject: str, request_id: str, code: ErrorCode, message: str, attempt: int) -> None:
        METRICS.errors.labels(code.value).inc()
        if request_id in self._tasks:
            self._failed.add(request_id)
        await self.publish_event(subject, ErrorEvent(request_id=request_id, code=code, message=message,
                                                     instance_id=self.instance_id, attempt=attempt))
