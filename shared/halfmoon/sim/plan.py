"""Capacity planning: the fewest instances whose simulated replay of a trace meets an SLO attainment target.

The simulator is the engine: every candidate layout is one replay through the Conductor's own policies.
The search assumes attainment never falls when a role gains an instance (checked on constructed traces
in tests/sim/test_plan.py; the live policies can break it by a request or two), which lets it skip most of
the grid:

1. disaggregated: double a balanced layout (1P+1D, 2P+2D, ...) until one meets the target; bisect the
   fewest prefill instances that meet it beside that many decode instances, and the fewest decode
   instances beside that many prefill ones. Their sum bounds every feasible layout from below, so totals
   are tried upward from it and the first total with a feasible split wins;
2. the same with chunked pipeline-parallel prefill (CPP) for each stage count asked for, used only for
   prompts a single node would prefill past the TTFT SLO (the setting that pays in docs/SIMULATION.md (f)),
   bisecting from the balanced size step 1 found;
3. aggregated (every instance prefills and decodes): double, then bisect the node count.

Each later search stops at the instance count of the best layout found so far.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from halfmoon.sim.config import SimConfig
from halfmoon.sim.profile import Profile
from halfmoon.sim.run import simulate
from halfmoon.sim.trace import TraceRequest

DISAGGREGATED, AGGREGATED = "disaggregated", "aggregated"


class PlanError(ValueError):
    """A planning setting is out of range, or the window holds no request."""


class Layout(NamedTuple):
    """``prefill`` + ``decode`` instances (disaggregated), or ``prefill`` instances that each prefill
    and decode (aggregated, ``decode`` = 0). ``cpp_stages`` > 0: long prompts may be pipelined over
    that many prefill instances."""

    mode: str
    prefill: int
    decode: int = 0
    cpp_stages: int = 0

    @property
    def instances(self) -> int:
        return self.prefill + self.decode

    @property
    def label(self) -> str:
        if self.mode == AGGREGATED:
            return f"{self.prefill} aggregated"
        return f"{self.prefill}P+{self.decode}D" + (f" cpp{self.cpp_stages}" if self.cpp_stages else "")


class Candidate(NamedTuple):
    layout: Layout
    attainment: float  # share of the window's requests within both SLOs
    goodput_rps: float  # requests within both SLOs per simulated second
    ttft_p90_s: float
    tbt_p90_s: float
    rejected: int
    meets: bool
    wall_s: float


class Plan(NamedTuple):
    choice: Candidate | None
    candidates: tuple[Candidate, ...]  # in the order they were simulated
    reason: str  # why the choice, or why there is none
    requests: int
    wall_s: float


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """``base`` carries everything but the layout (policies, SLOs, block size, time scale);
    ``pool_blocks_per_node`` is each caching node's share of the KVCache pool (None: unbounded)."""

    base: SimConfig
    target: float = 0.9
    max_instances: int = 64
    pool_blocks_per_node: int | None = None
    disaggregated: bool = True
    aggregated: bool = True
    aggregated_variant: str = "prefix"
    cpp_stages: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 < self.target <= 1.0:
            raise PlanError(f"the attainment target must be in (0, 1], got {self.target}")
        if self.max_instances < 2:
            raise PlanError(f"max_instances must be >= 2, got {self.max_instances}")
        if not (self.disaggregated or self.aggregated):
            raise PlanError("nothing to plan: both disaggregated and aggregated layouts are off")
        if any(k < 2 for k in self.cpp_stages):
            raise PlanError(f"CPP needs at least 2 stages, got {self.cpp_stages}")
        if self.cpp_stages and not self.disaggregated:
            raise PlanError("CPP needs disaggregated layouts")

    def config(self, layout: Layout) -> SimConfig:
        coupled = layout.mode == AGGREGATED
        # a pipeline needs as many prefill instances as stages; below that the layout runs without one
        stages = layout.cpp_stages if layout.cpp_stages <= layout.prefill else 0
        return dataclasses.replace(
            self.base,
            mode="coupled" if coupled else DISAGGREGATED,
            prefill_nodes=layout.prefill,
            decode_nodes=layout.decode,
            pool_blocks=None if self.pool_blocks_per_node is None else self.pool_blocks_per_node * layout.prefill,
            coupled_variant=self.aggregated_variant,
            coupled_router="local-cache-aware" if self.aggregated_variant == "prefix" else "load-balancing",
            cpp_stages=stages,
            cpp_min_single_ttft_s=self.base.slo.ttft_s if stages else 0.0,
        )


def window(trace: Sequence[TraceRequest], offset: int = 0, limit: int | None = None) -> list[TraceRequest]:
    """Requests ``offset`` .. ``offset + limit`` with arrivals shifted to start at 0."""
    if offset < 0 or (limit is not None and limit < 1):
        raise PlanError("the window needs offset >= 0 and limit >= 1")
    part = list(trace[offset: None if limit is None else offset + limit])
    if not part:
        raise PlanError(f"the window at offset {offset} holds no request (the trace has {len(trace)})")
    start = part[0].arrival_s
    return [r._replace(arrival_s=r.arrival_s - start) for r in part]


Evaluate = Callable[[Layout], Candidate]


def simulator(profile: Profile, trace: Sequence[TraceRequest], settings: PlanSettings) -> Evaluate:
    """One replay of ``trace`` per layout, scored against the settings' SLOs and target."""
    slo = settings.base.slo

    def evaluate(layout: Layout) -> Candidate:
        result = simulate(settings.config(layout), profile, trace)
        effective = int(result.outcomes.effective(slo.ttft_s, slo.tbt_s).sum())
        attainment = effective / len(trace)
        s = result.summary
        return Candidate(
            layout, attainment, effective / result.sim_seconds if result.sim_seconds > 0 else float(effective),
            s.ttft_p90, s.tbt_p90, s.rejected_early + s.rejected_late, attainment >= settings.target,
            result.wall_seconds,
        )

    return evaluate


class _Memo:
    """Each distinct simulator configuration runs once; ``tried`` keeps the order of first runs."""

    def __init__(self, evaluate: Evaluate, settings: PlanSettings) -> None:
        self.evaluate, self.settings = evaluate, settings
        self.by_config: dict[SimConfig, Candidate] = {}
        self.tried: list[Candidate] = []

    def __call__(self, layout: Layout) -> Candidate:
        key = self.settings.config(layout)
        if key not in self.by_config:
            self.by_config[key] = self.evaluate(layout)
            self.tried.append(self.by_config[key])
        return self.by_config[key]._replace(layout=layout)

    def meets(self, layout: Layout) -> bool:
        return self(layout).meets


def _fewest(meets: Callable[[int], bool], low: int, high: int) -> int:
    """Smallest n in [low, high] with meets(n), given meets(high) and monotone meets."""
    while low < high:
        mid = (low + high) // 2
        if meets(mid):
            high = mid
        else:
            low = mid + 1
    return high


def _first_doubling(meets: Callable[[int], bool], limit: int) -> tuple[int, int] | None:
    """(the last n that missed, the first that met) over n = 1, 2, 4, ..., ``limit``; None if none met."""
    missed, n = 0, 1
    while True:
        if meets(n):
            return missed, n
        if n >= limit:
            return None
        missed, n = n, min(2 * n, limit)


def _search_disaggregated(memo: _Memo, cap: int, stages: int, balanced: int | None) -> int | None:
    """Returns the balanced size that met the target (found by doubling unless given)."""
    def lay(p: int, d: int) -> Layout:
        return Layout(DISAGGREGATED, p, d, stages)

    if balanced is None:
        found = _first_doubling(lambda g: memo.meets(lay(g, g)), cap // 2)
        if found is None:
            return None
        balanced = found[1]
    # NOTE: CPP only takes prompts one node would serve late, so a size that met without it meets with it
    p_lo = _fewest(lambda p: memo.meets(lay(p, balanced)), 1, balanced)
    d_lo = _fewest(lambda d: memo.meets(lay(balanced, d)), 1, balanced)
    for total in range(p_lo + d_lo, min(2 * balanced, cap) + 1):
        # splits nearest the bounds' own ratio first; the whole total is tried so ties pick on attainment
        share = p_lo / (p_lo + d_lo)
        splits = sorted(range(p_lo, total - d_lo + 1), key=lambda p: abs(p - share * total))
        if [memo(lay(p, total - p)) for p in splits if memo.meets(lay(p, total - p))]:
            break
    return balanced


def _search_aggregated(memo: _Memo, cap: int) -> None:
    def lay(n: int) -> Layout:
        return Layout(AGGREGATED, n)

    found = _first_doubling(lambda n: memo.meets(lay(n)), cap)
    if found is not None:
        _fewest(lambda n: memo.meets(lay(n)), found[0] + 1, found[1])


def search(evaluate: Evaluate, settings: PlanSettings) -> tuple[Candidate | None, tuple[Candidate, ...]]:
    """The fewest-instance candidate meeting the target (ties: higher attainment, then no CPP), and
    every candidate simulated on the way."""
    memo = _Memo(evaluate, settings)

    def best() -> Candidate | None:
        feasible = [c for c in memo.tried if c.meets and c.layout.instances <= settings.max_instances]
        return min(feasible, key=lambda c: (c.layout.instances, -c.attainment, c.layout.cpp_stages), default=None)

    def cap() -> int:
        # a later search only needs layouts as small as the best so far (equal ones may win on attainment)
        found = best()
        return settings.max_instances if found is None else found.layout.instances

    if settings.disaggregated:
        balanced = _search_disaggregated(memo, cap(), 0, None)
        for stages in settings.cpp_stages:
            balanced = _search_disaggregated(memo, cap(), stages, balanced)
    if settings.aggregated:
        _search_aggregated(memo, cap())
    return best(), tuple(memo.tried)


def single_node_misses(profile: Profile, trace: Sequence[TraceRequest], ttft_s: float) -> int:
    """Requests whose whole prompt takes one idle node longer than the TTFT SLO to prefill (uncached)."""
    predict = profile.cost.prefill.predict
    return sum(predict(r.input_length, 0) > ttft_s for r in trace)


def plan(profile: Profile, trace: Sequence[TraceRequest], settings: PlanSettings,
         evaluate: Evaluate | None = None) -> Plan:
    started = time.perf_counter()
    if not trace:
        raise PlanError("the trace holds no request")
    choice, tried = search(evaluate or simulator(profile, trace, settings), settings)
    target = f"{settings.target:.1%} of {len(trace):,} requests"
    if choice is not None:
        smaller = [c for c in tried if c.layout.instances < choice.layout.instances]
        reason = (f"{choice.layout.label} is the fewest instances ({choice.layout.instances}) meeting {target}"
                  f" within TTFT {settings.base.slo.ttft_s:g} s and TBT {settings.base.slo.tbt_s * 1000:g} ms"
                  + (f"; {len(smaller)} smaller layouts tried missed it" if smaller else ""))
    else:
        best = max(tried, key=lambda c: c.attainment, default=None)
        reason = f"no layout of at most {settings.max_instances} instances meets {target}"
        if best is not None:
            reason += f"; the best tried, {best.layout.label}, reached {best.attainment:.1%}"
        misses = single_node_misses(profile, trace, settings.base.slo.ttft_s)
        ceiling = 1.0 - misses / len(trace)
        if misses and ceiling < settings.target and not settings.cpp_stages:
            reason += (f"; {misses} prompts take one node longer than the TTFT SLO to prefill, capping attainment"
                       f" without cache hits at {ceiling:.1%}: allow CPP (--cpp STAGES)")
    return Plan(choice, tried, reason, len(trace), time.perf_counter() - started)


def plan_json(result: Plan) -> dict:
    def row(c: Candidate) -> dict:
        def num(v: float) -> float | None:
            return None if math.isnan(v) else v

        return {"layout": c.layout._asdict(), "label": c.layout.label, "instances": c.layout.instances,
                "attainment": c.attainment, "goodput_rps": c.goodput_rps, "ttft_p90_s": num(c.ttft_p90_s),
                "tbt_p90_s": num(c.tbt_p90_s), "rejected": c.rejected, "meets": c.meets, "wall_s": c.wall_s}

    return {"choice": None if result.choice is None else row(result.choice),
            "candidates": [row(c) for c in result.candidates], "reason": result.reason,
            "requests": result.requests, "wall_s": result.wall_s}
