"""The conductor: live instance set from heartbeats, and ScheduleRequest -> a prefill/decode pair."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.trace import TracerProvider

from halfmoon.core.kv_spec import KVSpecMismatch
from halfmoon.policy.cost import OnlineFitter
from halfmoon.policy.ledger import Cleared, Stage, WorkLedger
from halfmoon.protocol import codecs
from halfmoon.protocol.base import Message
from halfmoon.protocol.pool import KVEvents, SnapshotRequest
from halfmoon.protocol.registry import Heartbeat, InstanceDown, Load, Role, StepSample, pooled_steps
from halfmoon.protocol.scheduling import (
    Placed,
    Readiness,
    ReadinessRequest,
    Rejected,
    RejectReason,
    ScheduleAccepted,
    ScheduleRejected,
    ScheduleRequest,
)
from halfmoon.protocol.work import CancelRequest, WorkDone, WorkOutcome
from halfmoon.runtime import Service, ServiceConfig
from halfmoon.services.conductor.placement import Placement, PlacementPolicy, place_pair
from halfmoon.services.conductor.policy_config import PolicySettings, build_placement
from halfmoon.services.conductor.registry import InstanceTable, InstanceView
from halfmoon.telemetry.metrics import METRICS, Metrics


@dataclass(frozen=True)
class ConductorConfig(ServiceConfig, PolicySettings):
    instance_timeout_s: float = field(default=3.0, metadata={"help": "drop an instance silent this long"})
    sweep_interval_s: float = field(default=0.25, metadata={"help": "how often to look for silent instances"})
    retry_after_s: float = field(default=1.0, metadata={"help": "Retry-After suggested on rejection"})
    ledger_grace_s: float = field(default=2.0, metadata={
        "help": "placed work missing from its instance's heartbeat this long is dropped from the ledger"})
    ledger_ttl_s: float = field(default=60.0, metadata={
        "help": "placed work with no news expires this long after its predicted end"})
    warmup_s: float = field(default=2.0, metadata={
        "help": "hear heartbeats this long before taking schedule requests (a conductor just started knows "
                "no instance, and would reject what its peers can place)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("instance_timeout_s", "sweep_interval_s", "ledger_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("retry_after_s", "ledger_grace_s", "warmup_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.check_policy()


class ConductorService(Service[ConductorConfig]):
    """Schedules on the ``schedule`` subject (queue group, so standbys never answer twice): a prefill
    and a decode instance, or, where no such pair is live, an aggregated instance for both phases.

    Several conductors run side by side, each a hot standby for the others: every one hears all
    heartbeats, KV events and the others' placements (Placed), so each has the whole picture
    and takes over the moment NATS stops routing schedule requests to a dead one.

    Each keeps a ledger of the work placed on every instance (its own placements and the others'),
    cleared by the instances' WorkDone, the requesters' cancellations, InstanceDown, heartbeats that
    hold less than it, and expiry: queue estimates drain however a request ends.
    """

    role = Role.CONDUCTOR
    config_class = ConductorConfig

    def __init__(
        self,
        config: ConductorConfig,
        tracer_provider: TracerProvider | None = None,
        policy: PlacementPolicy | None = None,
    ) -> None:
        super().__init__(config, tracer_provider)
        self.table = InstanceTable(config.instance_timeout_s)
        self.ledger = WorkLedger(config.ledger_grace_s)
        self._unscrape: Callable[[], None] = lambda: None
        built = build_placement(config)
        self.block_index, self.prefill_cost = built.block_index, built.prefill_cost
        self.decode_cost, self.shared_cost = built.decode_cost, built.shared_cost
        self.policy = policy or built.policy
        self._sweeper: asyncio.Task[None] | None = None
        self._refused: set[str] = set()  # instances whose KV spec disagrees (logged once each)
        self.first_tokens = FirstTokenWatch()

    def load(self) -> Load:
        return Load(running=len(self.table))

    async def start(self) -> None:
        await self.listen_heartbeats(self._on_heartbeat)
        await self.listen_downs(self._on_down)
        await self.listen(self.subjects.kv_events, codecs.KV_EVENTS, self._on_kv_events)
        await self.listen(self.subjects.placed, codecs.PLACED, self._on_placed)
        await self.listen(self.subjects.work_done, codecs.WORK_DONE, self._on_work_done)
        await self.listen(self.subjects.cancel, codecs.CANCEL, self._on_cancel)
        self._unscrape = METRICS.on_scrape(self._record_ledger)
        # Rebuild what prefill instances hold in their local caches (after a restart, too).
        await self.publish(self.subjects.kv_snapshot, SnapshotRequest())
        # NOTE: joining the schedule queue group before every instance has beaten once would send this
        # conductor its share of requests with an empty table: each would be rejected (no_decode_instance).
        await asyncio.sleep(self.config.warmup_s)
        await self.serve(
            self.subjects.schedule,
            codecs.SCHEDULE_REQUEST,
            self._on_schedule,
            span_name="conductor.schedule",
            queue="conductor",
        )
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="conductor-sweeper")

    async def _on_placed(self, placed: Placed, _headers: Mapping[str, str]) -> None:
        if placed.conductor != self.instance_id:
            self.ledger.place(placed.request_id, placement_stages(placed, time.monotonic()), time.monotonic())

    async def _on_work_done(self, done: WorkDone, _headers: Mapping[str, str]) -> None:
        held = any(s.instance_id == done.instance_id for s in self.ledger.stages(done.request_id))
        self.ledger.done(done.request_id, done.instance_id, _CLEARED[done.outcome], time.monotonic())
        if held and not any(s.instance_id == done.instance_id for s in self.ledger.stages(done.request_id)):
            self.table.request_left(done.instance_id)  # its last part there: out of the batch
        # NOTE: an instance reports its prefill part done as it sends the first token (prefill before the
        # hand-off, aggregated right after the token), so this is the TTFT delivered, from the placement.
        now = time.time()
        observed = self.first_tokens.done(done, now)
        if observed is not None:
            self.policy.observe_ttft(*observed, now=now)

    async def _on_cancel(self, cancel: CancelRequest, _headers: Mapping[str, str]) -> None:
        # NOTE: a cancel naming an attempt precedes that request's next placement, which replaces the
        # entries anyway; acting on it could clear the new placement if the two arrive out of order.
        # The first-token watch is left alone: a client that leaves right after its first token can cancel
        # before the prefill's WorkDone arrives, which still reports that token (and clears the entry).
        if cancel.attempt is None:
            self.ledger.end(cancel.request_id, time.monotonic())

    def _record_ledger(self, metrics: Metrics) -> None:
        metrics.conductor_outstanding.clear()
        metrics.conductor_outstanding_work.clear()
        for iid in {*self.ledger.instances(), *self.table.ids()}:
            held = self.ledger.outstanding(iid)
            metrics.conductor_outstanding.labels(iid).set(held.requests)
            metrics.conductor_outstanding_work.labels(iid).set(held.work_s)
        for how, total in self.ledger.cleared.items():
            metrics.ledger_cleared.labels(how.value).set(total)
        for name, fitter, predicted in (("prefill", self.prefill_cost, lambda f: f.predict(1024, 0)),
                                        ("decode", self.decode_cost, lambda f: f.predict(16, 16384)),
                                        ("decode_shared", self.shared_cost, lambda f: f.predict(16, 16384))):
            if fitter is not None:
                metrics.cost_model.labels(name, "seconds").set(predicted(fitter))
                metrics.cost_model.labels(name, "samples").set(len(fitter))
        calibration = self.policy.calibration
        if calibration is not None:
            fit = calibration.fit(time.time())
            for parameter, value in (("intercept_seconds", fit.intercept), ("slope", fit.slope),
                                     ("samples", len(calibration))):
                metrics.ttft_calibration.labels(parameter).set(value)

    async def _on_kv_events(self, events: KVEvents, _headers: Mapping[str, str]) -> None:
        self.block_index.apply(events.instance_id, events.stored, events.evicted, events.snapshot)
        if self.prefill_cost is not None:
            for new, cached, seconds in events.prefill_samples:
                self.prefill_cost.record(new, cached, seconds)

    async def close(self) -> None:
        self._unscrape()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def _on_heartbeat(self, heartbeat: Heartbeat, _headers: Mapping[str, str]) -> None:
        if heartbeat.kv_spec is not None:
            try:
                self.policy.adopt(heartbeat.kv_spec, heartbeat.instance_id)
            except KVSpecMismatch as exc:
                if heartbeat.instance_id not in self._refused:
                    self._refused.add(heartbeat.instance_id)
                    self.log.error("instance refused: its KV blocks would not match the others'",
                                   extra={"instance": heartbeat.instance_id, "why": str(exc)})
                return
        if heartbeat.role in (Role.DECODE, Role.AGGREGATED):
            self._learn_steps(heartbeat.load)
        now = time.monotonic()
        earlier = self.table.get(heartbeat.instance_id)
        if earlier is not None and earlier.incarnation and earlier.incarnation != heartbeat.incarnation:
            # NOTE: restarted faster than its silence could be noticed: the earlier run and its work are gone
            # now, not a timeout later; the notice names that run, so work placed on the new one stays.
            await self._declare_down(earlier, "restarted")
        self.ledger.reconcile(heartbeat.instance_id, heartbeat.load.queue_len + heartbeat.load.running, now)
        if self.table.observe(heartbeat, now):
            self.log.info("instance up", extra={"instance": heartbeat.instance_id, "role": heartbeat.role.value})

    def _learn_steps(self, load: Load) -> None:
        if self.decode_cost is None:
            return
        if self.shared_cost is None:
            # NOTE: one model for both kinds of step learns their mean as the decoding sequences saw it,
            # each kind weighted by how many steps it was; unweighted, one step that carried a prefill
            # chunk counted as much as the dozen decode-only steps around it, and the predicted TBT
            # rejected nearly every request on an aggregated instance whose tokens came well within the SLO.
            samples: tuple[tuple[StepSample | None, OnlineFitter], ...] = (
                (pooled_steps(load.steps, load.shared_steps), self.decode_cost),)
        else:
            samples = ((load.steps, self.decode_cost), (load.shared_steps, self.shared_cost))
        for sample, fitter in samples:
            if sample is not None:
                fitter.record(sample.batch, sample.kv_tokens, sample.seconds)

    async def _on_down(self, down: InstanceDown, _headers: Mapping[str, str]) -> None:
        known = self.table.get(down.instance_id)
        if known is not None and down.incarnation and known.incarnation not in ("", down.incarnation):
            return  # about an earlier run of an instance that is back: the run this table holds is live
        self.block_index.forget(down.instance_id)
        self.ledger.instance_down(down.instance_id, time.monotonic())
        if down.reason == "shutdown" and self.table.remove(down.instance_id) is not None:
            self.log.info("instance left", extra={"instance": down.instance_id, "reason": down.reason})

    async def _declare_down(self, gone: InstanceView, reason: str) -> None:
        """Forget ``gone`` (one run of an instance) and tell everyone holding work there."""
        self.block_index.forget(gone.instance_id)
        self.ledger.instance_down(gone.instance_id, time.monotonic())
        self.log.warning("instance down", extra={"instance": gone.instance_id, "reason": reason,
                                                 "incarnation": gone.incarnation})
        down = InstanceDown(instance_id=gone.instance_id, role=gone.role, reason=reason, timestamp=time.time(),
                            incarnation=gone.incarnation)
        await self.publish(self.subjects.down_from(self.role.value), down)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            if not self.nc.is_connected:
                # NOTE: cut off from NATS, this conductor hears no heartbeats: that proves nobody dead.
                # Holding every instance until the outage ends gives each a full timeout after it.
                self.table.hold(time.monotonic())
                continue
            self.ledger.expire(time.monotonic())
            for gone in self.table.expire(time.monotonic()):
                await self._declare_down(gone, "silent")

    async def _on_schedule(self, request: ScheduleRequest | ReadinessRequest) -> Message:
        if isinstance(request, ReadinessRequest):
            return self._readiness()
        if self.draining:
            return await self._reject(request, RejectReason.OVERLOADED, "conductor is shutting down")
        if request.deadline <= time.time():
            return await self._reject(request, RejectReason.DEADLINE, "deadline passed before scheduling")
        prefill, decode, aggregated = (self._candidates(role, request.exclude)
                                       for role in (Role.PREFILL, Role.DECODE, Role.AGGREGATED))
        choice = place_pair(self.policy, request, prefill, decode, aggregated, now=time.time())
        if not isinstance(choice, Placement):
            return await self._reject(request, choice.reason, choice.message, choice.retry_after_s, choice.clears_in_s)
        if aggregated and prefill and decode:
            self._record_serving(request, choice)
        if choice.step_target_s:
            METRICS.paced_placements.inc()
        self._record_decode_load(choice, [*decode, *aggregated])
        ttft_s = (choice.predicted_ttft_ms or 0.0) / 1000
        placed = Placed(conductor=self.instance_id, prefill_instance=choice.prefill, decode_instance=choice.decode,
                        request_id=request.request_id, prefill_s=choice.prefill_s, prompt_tokens=request.prompt_len,
                        max_tokens=request.sampling.max_tokens, reused_tokens=choice.reused_tokens,
                        pipeline=choice.pipeline, paced=choice.step_target_s > 0,
                        ttl_s=self.config.ledger_ttl_s + 2 * ttft_s,
                        decode_ttl_s=self.config.ledger_ttl_s + 2 * (ttft_s + request.sampling.max_tokens
                                                                     * self.config.tbt_slo_s))
        self.ledger.place(request.request_id, placement_stages(placed, time.monotonic()), time.monotonic())
        if self.policy.calibration is not None and choice.model_ttft_ms is not None:  # only calibration reads it
            self.first_tokens.expect(request.request_id, choice.prefill, choice.model_ttft_ms / 1000, time.time())
        await self.publish(self.subjects.placed, placed)
        return ScheduleAccepted(
            request_id=request.request_id,
            prefill_instance=choice.prefill,
            decode_instance=choice.decode,
            predicted_ttft_ms=choice.predicted_ttft_ms,
            pipeline=choice.pipeline,
            predicted_tbt_ms=choice.predicted_tbt_ms,
            prefill_incarnation=self._incarnation(choice.prefill),
            decode_incarnation=self._incarnation(choice.decode),
            step_target_s=choice.step_target_s,
        )

    def _record_serving(self, request: ScheduleRequest, choice: Placement) -> None:
        """Pairs and aggregated instances are both live: which the request got, and what each was predicted
        to cost (absent: that option was rejected, or the policy does not predict costs)."""
        serving = "whole" if choice.whole else "handoff"
        costs = {name: value for name, value in (("handoff", choice.handoff_cost_s), ("whole", choice.whole_cost_s))
                 if value is not None}
        trace.get_current_span().set_attributes({
            "halfmoon.serving": serving, "halfmoon.prefill_instance": choice.prefill,
            **{f"halfmoon.cost.{name}_s": value for name, value in costs.items()}})
        self.log.debug("hand-off or whole", extra={"request_id": request.request_id, "serving": serving,
                                                    "instance": choice.prefill,
                                                    **{f"{name}_cost_s": value for name, value in costs.items()}})

    @staticmethod
    def _record_decode_load(choice: Placement, candidates: list[InstanceView]) -> None:
        """The decode instance's load as this placement saw it: what its predicted TBT was made from, so a
        prediction's error can be read from the request's trace."""
        view = next((v for v in candidates if v.instance_id == choice.decode), None)
        span = trace.get_current_span()
        if view is None or not span.is_recording():
            return
        load, window = view.load, view.load.window_steps
        span.set_attributes({
            "halfmoon.decode.running": view.running, "halfmoon.decode.placed": view.outstanding.requests,
            **({} if choice.predicted_tbt_ms is None else {"halfmoon.tbt.predicted_ms": choice.predicted_tbt_ms}),
            **({"halfmoon.prefill.step_target_ms": choice.step_target_s * 1000} if choice.step_target_s else {}),
            **({} if load.shared_step_fraction is None else {"halfmoon.decode.shared_step_fraction":
                                                            load.shared_step_fraction}),
            **({} if window is None else {"halfmoon.decode.window_step_ms": window.seconds * 1000,
                                          "halfmoon.decode.window_prompt_ms": load.window_prompt_s * 1000,
                                          "halfmoon.decode.window_batch": window.batch})})

    def _incarnation(self, instance_id: str) -> str:
        view = self.table.get(instance_id)
        return view.incarnation if view is not None else ""

    def _readiness(self) -> Readiness:
        prefill, decode, aggregated = (len(self.table.candidates(role))
                                       for role in (Role.PREFILL, Role.DECODE, Role.AGGREGATED))
        ready = not self.draining and ((prefill > 0 and decode > 0) or aggregated > 0)
        return Readiness(conductor=self.instance_id, ready=ready, prefill=prefill, decode=decode,
                         aggregated=aggregated)

    async def _reject(self, request: ScheduleRequest, reason: RejectReason, message: str,
                      retry_after_s: float | None = None, clears_in_s: float | None = None) -> ScheduleRejected:
        self.log.info("rejected", extra={"request_id": request.request_id, "reason": reason.value, "why": message})
        # NOTE: every reason is demand left unserved, which the planner must see (placements alone hide an
        # overload). Like Placed, the note never waits: nats-py buffers it while NATS is away.
        await self.publish(self.subjects.rejected, Rejected(
            conductor=self.instance_id, request_id=request.request_id, reason=reason,
            prompt_tokens=request.prompt_len, max_tokens=request.sampling.max_tokens))
        retry = self.config.retry_after_s if retry_after_s is None else retry_after_s
        return ScheduleRejected(request_id=request.request_id, reason=reason, message=message, retry_after_s=retry,
                                clears_in_s=clears_in_s)


    def _candidates(self, role: Role, exclude: tuple[str, ...]) -> list[InstanceView]:
        """Live instances of ``role`` with the work the ledger holds for them, minus those the requester
        saw fail, unless that leaves none (they may be back)."""
        views = [v._replace(outstanding=self.ledger.outstanding(v.instance_id)) for v in self.table.candidates(role)]
        kept = [v for v in views if v.instance_id not in exclude]
        return kept or views


class FirstTokenWatch:
    """This conductor's placements awaiting their first token, with the TTFT the cost model predicted.
    At most ``limit`` are held (the oldest go first): one whose outcome never arrives is forgotten."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._waiting: dict[str, tuple[str, float, float]] = {}  # request -> (prefill instance, model s, placed at)

    def expect(self, request_id: str, prefill_instance: str, model_ttft_s: float, now: float) -> None:
        self._waiting.pop(request_id, None)  # a new attempt replaces the old one, and is the newest
        self._waiting[request_id] = (prefill_instance, model_ttft_s, now)
        if len(self._waiting) > self.limit:
            del self._waiting[next(iter(self._waiting))]

    def done(self, done: WorkDone, now: float) -> tuple[float, float] | None:
        """(model TTFT, delivered TTFT) when ``done`` is the placed prefill instance completing its part."""
        waiting = self._waiting.get(done.request_id)
        if waiting is None or waiting[0] != done.instance_id:
            return None  # not placed here, or an instance of an earlier attempt
        del self._waiting[done.request_id]
        if done.outcome is not WorkOutcome.COMPLETED:
            return None
        return waiting[1], now - waiting[2]

    def __len__(self) -> int:
        return len(self._waiting)


_CLEARED = {WorkOutcome.COMPLETED: Cleared.COMPLETED, WorkOutcome.FAILED: Cleared.FAILED,
            WorkOutcome.CANCELLED: Cleared.CANCELLED}


def placement_stages(placed: Placed, now: float) -> tuple[Stage, ...]:
    """The ledger entries of one placement: prefill first (every stage of a pipelined prefill), then decode
    (due once prefill is done). An aggregated instance doing both holds both entries and reports the end
    of each: its prefill work must leave the queue estimate at the first token, not when decoding ends."""
    pipeline = () if placed.prefill_instance == placed.decode_instance else placed.pipeline
    prefill = (Stage(iid, 0, now + placed.ttl_s, placed.prefill_s, placed.prompt_tokens, paced=placed.paced)
               for iid in (placed.prefill_instance, *pipeline))
    return (*prefill, Stage(placed.decode_instance, 1, now + placed.decode_ttl_s, 0.0, placed.prompt_tokens,
                            placed.max_tokens))
