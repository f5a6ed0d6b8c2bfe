"""The online planner's decision: the instance counts for the next interval, from the forecast load and the
simulator, with a reason an operator can read.

Rule (docs/PLANNER.md):

- **up** when the current layout misses the attainment target at the forecast load (simulated): straight
  to the fewest-instance layout of the same mode that meets it (``halfmoon plan``'s search), never
  below the current count of any role; capacity late is SLO lost, so scale-up waits for nothing;
- **down** one instance at a time, when one fewer still meets the target at the forecast load times
  ``1 + headroom`` and ``cooldown_intervals`` have passed since the last change. The headroom is the
  hysteresis band: a layout sized up for a load is never sized down for the same load, so steady
  load does not flap; the cool-down lets an instance just added (or drained) show in the measurements
  before the next step down;
- **hold** otherwise.

Pure: no clock (intervals are counted by the caller's calls), no I/O; the simulator comes in as a
function, so tests can give it a constructed capacity surface.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

from halfmoon.sim.forecast import IntervalLoad
from halfmoon.sim.plan import AGGREGATED, DISAGGREGATED, Evaluate, Layout, PlanError, PlanSettings, search
from halfmoon.sim.trace import TraceRequest

EvaluateAt = Callable[[IntervalLoad], Evaluate]  # the simulator at one load: layout -> its replay's score


@dataclasses.dataclass(frozen=True)
class ScalingSettings:
    """``plan`` carries the simulator settings, SLOs, attainment target and ``max_instances``; ``mode``
    is the deployment's (aggregated or disaggregated: the planner resizes pools, it does not change
    the architecture); ``horizon_s`` is how much forecast load each decision simulates."""

    plan: PlanSettings
    mode: str = AGGREGATED
    horizon_s: float = 30.0
    headroom: float = 0.25
    cooldown_intervals: int = 3

    def __post_init__(self) -> None:
        if self.mode not in (AGGREGATED, DISAGGREGATED):
            raise PlanError(f"mode must be {AGGREGATED} or {DISAGGREGATED}, got {self.mode!r}")
        if self.horizon_s <= 0 or self.headroom < 0 or self.cooldown_intervals < 0:
            raise PlanError("horizon_s must be > 0, headroom and cooldown_intervals >= 0")

    @property
    def smallest(self) -> Layout:
        return Layout(AGGREGATED, 1) if self.mode == AGGREGATED else Layout(DISAGGREGATED, 1, 1)

    @property
    def search_settings(self) -> PlanSettings:
        """``plan`` limited to this mode, without pipelines (CPP is a per-request choice, not a pool size)."""
        return dataclasses.replace(self.plan, disaggregated=self.mode == DISAGGREGATED,
                                   aggregated=self.mode == AGGREGATED, cpp_stages=())


class Decision(NamedTuple):
    target: Layout
    action: str  # "up", "down" or "hold"
    reason: str


def forecast_trace(load: IntervalLoad, horizon_s: float, block_size: int, backlog: int = 0) -> list[TraceRequest]:
    """``horizon_s`` of ``load`` as a trace: arrivals evenly spaced at the forecast rate (a rate is all a
    forecast knows; the headroom covers bursts), every prompt of the mean length, its first ``reuse``
    share of blocks common to all (the cached prefix), the rest its own. ``backlog`` requests, waiting in the
    deployment now, arrive first, all at once: a deployment that fell behind must also work off its queue,
    and one sized for the arrival rate alone never does (its TTFTs stay as long as the queue it started with)."""
    count = math.floor(load.arrival_rps * horizon_s)
    prompt, output = max(1, round(load.prompt_tokens)), max(1, round(load.output_tokens))
    blocks = -(-prompt // block_size)
    shared = min(blocks, math.floor(load.reuse * prompt / block_size))
    arrivals = [0.0] * backlog + [i / load.arrival_rps for i in range(count)]
    return [TraceRequest(at, prompt, output,
                         (*range(shared), *range(blocks + i * blocks + shared, blocks + (i + 1) * blocks)))
            for i, at in enumerate(arrivals)]


def _describe(load: IntervalLoad) -> str:
    return (f"{load.arrival_rps:.2f} req/s of {load.prompt_tokens:.0f} prompt tokens ({load.reuse:.0%} cached) "
            f"and {load.output_tokens:.0f} output tokens")


class Scaler:
    """Decides each interval; keeps only the intervals since the last change (for the cool-down)."""

    def __init__(self, settings: ScalingSettings) -> None:
        self.settings = settings
        self.since_change = settings.cooldown_intervals  # a fresh planner may step down at once

    def decide(self, current: Layout, forecast: IntervalLoad | None, evaluate_at: EvaluateAt,
               backlog: int = 0) -> Decision:
        """``backlog``: requests waiting in the deployment now, which ``evaluate_at`` simulates first."""
        s = self.settings
        if current.mode != s.mode:
            raise PlanError(f"the deployment is {current.mode}, the planner plans {s.mode}")
        self.since_change += 1
        if forecast is None:
            return Decision(current, "hold", "no request seen yet: nothing to forecast from")
        expected = forecast.arrival_rps * s.horizon_s
        if expected < 1 and not backlog:
            return self._down(current, f"forecast {forecast.arrival_rps:.3f} req/s: under one request in the next "
                                       f"{s.horizon_s:g} s", None)
        evaluate = evaluate_at(forecast)
        now = evaluate(current)
        target_text = f"{s.plan.target:.0%} within TTFT {s.plan.base.slo.ttft_s:g} s, TBT {s.plan.base.slo.tbt_s * 1000:g} ms"
        if not now.meets:
            best, tried = search(evaluate, s.search_settings)
            if best is None:
                fallback = max(tried, key=lambda c: (c.attainment, c.layout.instances))  # ties: the most capacity
                goal, note = fallback.layout, (f"no layout of at most {s.plan.max_instances} instances meets it; "
                                               f"the best, {fallback.layout.label}, reaches {fallback.attainment:.0%}")
            else:
                goal, note = best.layout, f"{best.layout.label} is the fewest that meets it ({best.attainment:.0%})"
            target = current._replace(prefill=max(current.prefill, goal.prefill),
                                      decode=max(current.decode, goal.decode))
            why = (f"{current.label} reaches {now.attainment:.0%} at the forecast {_describe(forecast)}, short of "
                   f"{target_text}; {note}")
            if target == current:
                return Decision(current, "hold", why + "; already there")
            self.since_change = 0
            return Decision(target, "up", why)
        return self._down(current, f"{current.label} reaches {now.attainment:.0%} at the forecast {_describe(forecast)}"
                                   f" ({target_text})", evaluate_at(forecast.scaled(1 + s.headroom)))

    def _down(self, current: Layout, why: str, evaluate: Evaluate | None) -> Decision:
        """One instance fewer, if the cool-down is over and (``evaluate`` given) it meets the target with
        headroom; decode before prefill, whose count also sets the KVCache pool's size."""
        s, floor = self.settings, self.settings.smallest
        smaller = [current._replace(decode=current.decode - 1)] if current.decode > floor.decode else []
        if current.prefill > floor.prefill:
            smaller.append(current._replace(prefill=current.prefill - 1))
        if not smaller:
            return Decision(current, "hold", f"{why}; already the smallest layout")
        if self.since_change < s.cooldown_intervals:
            return Decision(current, "hold", f"{why}; cooling down ({self.since_change}/{s.cooldown_intervals} "
                                             "intervals since the last change)")
        for layout in smaller:
            if evaluate is None:
                self.since_change = 0
                return Decision(layout, "down", f"{why}; draining one instance to {layout.label}")
            fewer = evaluate(layout)
            if fewer.meets:
                self.since_change = 0
                return Decision(layout, "down", f"{why}; {layout.label} meets it at {1 + s.headroom:g}x the forecast "
                                                f"({fewer.attainment:.0%}): draining one instance")
        return Decision(current, "hold", f"{why}; one fewer misses at {1 + s.headroom:g}x the forecast")
