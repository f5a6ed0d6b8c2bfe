"""The online planner: every interval it reads what the deployment reported, forecasts the next interval
(sim/forecast.py), asks the simulator for the counts that meet the SLOs at that load (sim/planner.py) and
applies them through an :class:`Actuator`.

Locally (`halfmoon up --planner`) it runs inside the launcher, not as a process of its own: the local
actuator is the launcher's process table, and the launcher's supervision loop (the one thread that starts
and restarts processes) also applies the planner's counts, so nothing races on it and no NATS subject or
role is needed to ask the launcher for instances. A compose deployment runs it as a service of its own
(services/halfmoon/services/planner) over the Docker API (deploy/docker_actuator.py). Either way its NATS
reading runs in a thread of its own, as the ``planner`` user, which may only listen (docs/PLANNER.md).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer

from halfmoon.deploy.local import LocalCluster
from halfmoon.policy.state import SERVING_SLO, SLO
from halfmoon.protocol import codecs
from halfmoon.protocol.permissions import PLANNER
from halfmoon.protocol.registry import Role
from halfmoon.protocol.subjects import Subjects
from halfmoon.runtime.rpc import subscriptions_live
from halfmoon.sim.config import SimConfig
from halfmoon.sim.forecast import IntervalLoad, LoadForecaster, Smoothing
from halfmoon.sim.plan import AGGREGATED, DISAGGREGATED, Evaluate, Layout, PlanSettings, simulator
from halfmoon.sim.planner import Decision, Scaler, ScalingSettings, forecast_trace
from halfmoon.sim.profile import DEFAULT_PROFILE, Profile, load_profile
from halfmoon.telemetry.tracing import setup_tracing

log = logging.getLogger("halfmoon.planner")

ENGINE_ROLES = (Role.PREFILL, Role.DECODE, Role.AGGREGATED)
RECENT_REQUESTS = 100_000  # request ids remembered so a request rejected or placed again (a retry) counts once


@dataclass(frozen=True)
class PlannerConfig:
    """What the pools are sized to, and how often; a planner service's config has these fields too."""

    interval_s: float = field(default=5.0, metadata={"help": "seconds between the planner's decisions"})
    profile: str = field(default=DEFAULT_PROFILE, metadata={
        "help": "cost profile (name or JSON file, docs/SIMULATION.md) of the machines the engines run on"})
    ttft_slo_s: float = field(default=SERVING_SLO.ttft_s, metadata={"help": "TTFT the pools are sized for"})
    tbt_slo_s: float = field(default=SERVING_SLO.tbt_s, metadata={"help": "TBT the pools are sized for"})
    target: float = field(default=0.9, metadata={"help": "share of requests to serve within both SLOs"})
    max_instances: int = field(default=4, metadata={"help": "engine instances at most (at least 2)"})
    horizon_s: float = field(default=30.0, metadata={"help": "seconds of forecast load simulated per decision"})
    headroom: float = field(default=0.25, metadata={
        "help": "extra load (a share) one instance fewer must carry before a scale-down"})
    cooldown_intervals: int = field(default=3, metadata={"help": "intervals after a change before a scale-down"})
    smoothing_alpha: float = field(default=Smoothing.alpha, metadata={"help": "Holt's level weight"})
    smoothing_beta: float = field(default=Smoothing.beta, metadata={"help": "Holt's trend weight"})

    @property
    def smoothing(self) -> Smoothing:
        return Smoothing(self.smoothing_alpha, self.smoothing_beta)

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        self.smoothing  # noqa: B018 - validates the weights
        self.scaling(AGGREGATED, 1)  # validates the rest

    def scaling(self, mode: str, block_size: int) -> ScalingSettings:
        base = SimConfig(slo=SLO(self.ttft_slo_s, self.tbt_slo_s), block_size=block_size)
        return ScalingSettings(PlanSettings(base, target=self.target, max_instances=self.max_instances), mode=mode,
                               horizon_s=self.horizon_s, headroom=self.headroom,
                               cooldown_intervals=self.cooldown_intervals)


class Actuator(ABC):
    """Applies the planner's counts to a deployment.

    Contract: ``counts()`` is, per engine role, the instances the deployment runs and that are not leaving
    (those still starting count: asking twice for the same instance must not start two). ``scale_to(role,
    n)`` returns once the change is under way, not done, naming the instances it started or drained.
    Scale-up starts instances, which serve once their heartbeats reach the conductor. Scale-down drains
    first: one instance at a time gets SIGTERM (or its platform's equivalent), after which it takes no new
    work (its heartbeat says leaving=draining, and the conductor places nothing more on it), finishes or
    hands back what it holds within its drain timeout, and exits; it is not restarted. Nothing is killed
    to scale down, so no request is lost to it.
    """

    @abstractmethod
    def counts(self) -> dict[Role, int]: ...

    @abstractmethod
    def scale_to(self, role: Role, count: int) -> list[str]: ...

    def close(self, timeout_s: float | None = None) -> None:  # noqa: B027 - most have nothing to end
        """Give the drains still under way up to ``timeout_s`` to finish, then let go."""


class LocalActuator(Actuator):
    """The processes of a :class:`LocalCluster`; call it from the thread that supervises the cluster."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster

    def counts(self) -> dict[Role, int]:
        return {role: len(self.cluster.members(role.value)) for role in ENGINE_ROLES}

    def scale_to(self, role: Role, count: int) -> list[str]:
        members = self.cluster.members(role.value)
        if count >= len(members):
            return [self.cluster.add_instance(role.value) for _ in range(count - len(members))]
        # the newest go first: the first instances keep their ids (and their caches) across a ramp
        leaving = sorted(members, key=lambda iid: int(iid.rsplit("-", 1)[1]))[count:]
        for instance_id in leaving:
            self.cluster.retire_instance(instance_id)
        return leaving


class Report(NamedTuple):
    """One interval of what the deployment reported: its requests (placed, or rejected and not placed before),
    and the engines' latest heartbeats."""

    requests: int
    rejected: int  # of ``requests``, those heard of first as rejected (placed later or not)
    prompt_tokens: int
    output_tokens: int  # requested (max_tokens): the most each request may produce
    placed_prompt_tokens: int  # the prompt tokens of the interval's placements, whose reuse is known
    reused_tokens: int  # of ``placed_prompt_tokens``
    tbt_ms: dict[str, float]  # engine instance -> its recent mean time between tokens
    block_size: int | None  # the engines' KV block size (from their KV spec), None before a heartbeat
    backlog: int = 0  # requests the engines hold and have not started (their latest heartbeats' queues)

    def load(self, seconds: float) -> IntervalLoad:
        """The interval's load; its reuse is the placements' (a rejected request's would-be reuse is not
        known), 0 when every request was turned away: an overload is planned for as if nothing were cached."""
        if not self.requests:
            return IntervalLoad(0.0, 0.0, 0.0, 0.0)
        return IntervalLoad(self.requests / seconds, self.prompt_tokens / self.requests,
                            self.output_tokens / self.requests,
                            self.reused_tokens / max(1, self.placed_prompt_tokens))


@dataclass
class _Counts:
    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    placed_prompt_tokens: int = 0
    reused_tokens: int = 0


class Watch:
    """Reads heartbeats and the conductors' ``Placed`` and ``Rejected`` notes off NATS in a thread of its own;
    ``take`` hands over what came since the last call. ``connect`` makes its connection, in that thread's
    event loop.

    A request counts once, in the interval it was first heard of, however often it was rejected (the
    gateway retries under the same request id) or placed (a migration places it again): unplaced demand
    is load too, and placements alone hide an overload. Its placement, if it comes, still tells its reuse.
    """

    def __init__(self, connect: Callable[[], Awaitable[Client]], subjects: Subjects) -> None:
        self.connect, self.subjects = connect, subjects
        self._lock = threading.Lock()
        self._placed: OrderedDict[str, bool] = OrderedDict()  # request id -> placed yet (else: rejected so far)
        self._counts = _Counts()
        self._tbt_ms: dict[str, float] = {}
        self._queued: dict[str, int] = {}  # engine instance -> requests waiting there, its latest heartbeat
        self._block_size: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="planner-watch", daemon=True)

    def start(self, timeout: float = 15.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the planner could not subscribe to NATS within {timeout}s")
        if self._failure is not None:
            raise self._failure

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def take(self) -> Report:
        with self._lock:
            c, self._counts = self._counts, _Counts()
            return Report(c.requests, c.rejected, c.prompt_tokens, c.output_tokens, c.placed_prompt_tokens,
                          c.reused_tokens, dict(self._tbt_ms), self._block_size, sum(self._queued.values()))

    def _run(self) -> None:
        try:
            asyncio.run(self._watch())
        except BaseException as exc:  # handed to start(), which raises it in the launcher
            self._failure = exc
            self._ready.set()

    async def _watch(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        nc = await self.connect()
        try:
            await nc.subscribe(self.subjects.heartbeat, cb=self._on_heartbeat)
            await nc.subscribe(self.subjects.placed, cb=self._on_placed)
            await nc.subscribe(self.subjects.rejected, cb=self._on_rejected)
            await subscriptions_live(nc)
            self._ready.set()
            await self._stop.wait()
        finally:
            await nc.close()

    async def _on_heartbeat(self, msg: Msg) -> None:
        beat = codecs.HEARTBEAT.decode(msg.data)
        if beat.role not in ENGINE_ROLES:
            return
        with self._lock:
            if beat.kv_spec is not None:
                self._block_size = beat.kv_spec.block_size
            if beat.leaving is None and beat.load.tbt_ms is not None and beat.role is not Role.PREFILL:
                self._tbt_ms[beat.instance_id] = beat.load.tbt_ms
            else:
                self._tbt_ms.pop(beat.instance_id, None)
            if beat.leaving is None:
                self._queued[beat.instance_id] = beat.load.queue_len
            else:  # what a leaving instance holds it finishes or hands back; a new one counts it then
                self._queued.pop(beat.instance_id, None)

    async def _on_placed(self, msg: Msg) -> None:
        placed = codecs.PLACED.decode(msg.data)
        with self._lock:
            if self._placed.get(placed.request_id):
                return
            if placed.request_id not in self._placed:
                self._count_request(placed.request_id, placed.prompt_tokens, placed.max_tokens)
            self._placed[placed.request_id] = True
            self._counts.placed_prompt_tokens += placed.prompt_tokens
            self._counts.reused_tokens += placed.reused_tokens

    async def _on_rejected(self, msg: Msg) -> None:
        rejected = codecs.REJECTED.decode(msg.data)
        with self._lock:
            if rejected.request_id in self._placed:
                return
            self._count_request(rejected.request_id, rejected.prompt_tokens, rejected.max_tokens)
            self._placed[rejected.request_id] = False
            self._counts.rejected += 1

    def _count_request(self, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        """A request heard of for the first time (the caller holds the lock)."""
        if len(self._placed) >= RECENT_REQUESTS:
            self._placed.popitem(last=False)
        self._counts.requests += 1
        self._counts.prompt_tokens += prompt_tokens
        self._counts.output_tokens += max_tokens


def deployment_mode(counts: Mapping[Role, int]) -> str:
    if counts[Role.AGGREGATED] and not (counts[Role.PREFILL] or counts[Role.DECODE]):
        return AGGREGATED
    if counts[Role.PREFILL] and counts[Role.DECODE] and not counts[Role.AGGREGATED]:
        return DISAGGREGATED
    raise ValueError("the planner sizes aggregated pools or prefill and decode pools, not both at once: "
                     f"the deployment runs {dict(counts)}")


class Planner:
    """``tick(now)`` as often as the caller likes (the launcher: every second); every ``interval_s`` it
    decides and applies. ``report`` gets each decision's line; each is also a span ``planner.decide``."""

    def __init__(self, config: PlannerConfig, actuator: Actuator, watch: Watch, profile: Profile, tracer: Tracer,
                 report: Callable[[str], None] = lambda _line: None) -> None:
        self.config, self.actuator, self.watch, self.profile = config, actuator, watch, profile
        self.tracer, self.report = tracer, report
        self.mode = deployment_mode(actuator.counts())
        self.forecaster = LoadForecaster(config.smoothing)
        self.scaler: Scaler | None = None  # made once the engines' block size is known
        self._last: float | None = None

    def layout(self) -> Layout:
        counts = self.actuator.counts()
        if self.mode == AGGREGATED:
            return Layout(AGGREGATED, counts[Role.AGGREGATED])
        return Layout(DISAGGREGATED, counts[Role.PREFILL], counts[Role.DECODE])

    def tick(self, now: float) -> Decision | None:
        if self._last is None:
            self._last = now
            self.watch.take()  # what came before the first interval began is no interval's
            return None
        if now - self._last < self.config.interval_s:
            return None
        seconds, self._last = now - self._last, now
        seen = self.watch.take()
        if seen.block_size is None:
            return None  # no engine has heartbeaten yet
        if self.scaler is None:
            self.scaler = Scaler(self.config.scaling(self.mode, seen.block_size))
        scaling = self.scaler.settings
        self.forecaster.observe(seen.load(seconds), seen.requests)
        forecast = self.forecaster.forecast()

        def evaluate_at(load: IntervalLoad) -> Evaluate:
            return simulator(self.profile, forecast_trace(load, scaling.horizon_s, seen.block_size or 1, seen.backlog),
                             scaling.plan)

        current = self.layout()
        with self.tracer.start_as_current_span("planner.decide") as span:
            started = time.perf_counter()
            decision = self.scaler.decide(current, forecast, evaluate_at, seen.backlog)
            changed = self._apply(current, decision.target)
            worst = max(seen.tbt_ms.values(), default=None)
            measured = ("no TBT measured" if worst is None else
                        f"measured TBT up to {worst:.0f} ms (SLO {self.config.tbt_slo_s * 1000:g} ms)")
            line = (f"{decision.action} {current.label} -> {decision.target.label}: {decision.reason}; "
                    f"{seen.requests} requests in the last {seconds:.1f} s ({seen.rejected} rejected), "
                    f"{seen.backlog} waiting, {measured}"
                    + (f"; {', '.join(changed)}" if changed else ""))
            span.set_attributes({"planner.action": decision.action, "planner.current": current.label,
                                 "planner.target": decision.target.label, "planner.reason": decision.reason,
                                 "planner.requests": seen.requests, "planner.rejected": seen.rejected,
                                 "planner.backlog": seen.backlog,
                                 "planner.changed": changed,
                                 "planner.decide_s": time.perf_counter() - started,
                                 **({} if forecast is None else {f"planner.forecast.{k}": v
                                                                 for k, v in forecast._asdict().items()})})
        log.info(line)
        self.report(line)
        return decision

    def _apply(self, current: Layout, target: Layout) -> list[str]:
        roles = ((Role.AGGREGATED, current.prefill, target.prefill),) if self.mode == AGGREGATED else (
            (Role.PREFILL, current.prefill, target.prefill), (Role.DECODE, current.decode, target.decode))
        changed = []
        for role, have, want in roles:
            if want != have:
                verb = "started" if want > have else "draining"
                changed += [f"{verb} {iid}" for iid in self.actuator.scale_to(role, want)]
        return changed


class RunningPlanner:
    """A :class:`Planner` with its watch started and its spans' provider, as the launcher and the planner
    service run it: ``tick`` as often as you like (it decides every ``interval_s``) and never raises, ``close``
    when done."""

    def __init__(self, config: PlannerConfig, actuator: Actuator, watch: Watch, provider: TracerProvider,
                 report: Callable[[str], None] = lambda _line: None) -> None:
        self.watch, self.provider = watch, provider
        self.planner = Planner(config, actuator, watch, load_profile(config.profile),
                               provider.get_tracer("halfmoon.planner"), report)
        self.watch.start()

    def tick(self, now: float | None = None) -> Decision | None:
        try:
            return self.planner.tick(time.monotonic() if now is None else now)
        except Exception as exc:
            # NOTE: a planner that fails must not take the deployment down: the pools stay as they are
            log.exception("planner failed")
            self.planner.report(f"failed, the pools stay as they are: {exc!r}")
            return None

    def run(self, stop: threading.Event, period_s: float = 1.0) -> None:
        """Tick every ``period_s`` until ``stop`` is set (a process of its own; the launcher ticks it itself)."""
        while not stop.wait(period_s):
            self.tick()

    def close(self) -> None:
        self.watch.stop()
        self.provider.shutdown()  # flushes the last spans


class LocalPlanner(RunningPlanner):
    """Over a started :class:`LocalCluster`: reads NATS as the ``planner`` user, writes its decisions to
    ``logs/planner.log`` and its spans to the cluster's span file."""

    def __init__(self, cluster: LocalCluster, config: PlannerConfig,
                 report: Callable[[str], None] = lambda _line: None) -> None:
        url = cluster.nats_url
        assert url is not None, "start the cluster first"
        options = cluster.nats_auth.connect_options(PLANNER) if cluster.nats_auth is not None else {}
        self.log_file = cluster.log_file("planner")

        def both(line: str) -> None:
            with Path(self.log_file).open("a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
            report(line)

        watch = Watch(lambda: nats.connect(url, connect_timeout=5, max_reconnect_attempts=-1, **options),
                      Subjects(cluster.namespace))
        super().__init__(config, LocalActuator(cluster), watch,
                         setup_tracing("planner", "planner", trace_file=str(cluster.trace_file)), both)
