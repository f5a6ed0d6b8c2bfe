"""`halfmoon plan` on the conversation trace: how long a 10,000-request window takes, and the planner's
choice against the best fixed P:D split a full grid search finds, under the same SLOs.

Run: python -m benchmarks.plan_speed [--grid MAX] [--windows N]
Prints markdown tables for docs/BENCHMARKS.md. CPU seconds are this process's; wall seconds include
whatever else the machine runs.

- speed: plan the first 10,000 requests (TTFT 30 s, TBT 100 ms, 90%), disaggregated and aggregated layouts;
- grid: every P + D <= MAX on the whole trace; the best fixed split is the fewest instances meeting the
  target (ties: higher attainment); the planner runs on the same trace and settings;
- windows: the planner on N consecutive windows of equal request counts, each simulated from a cold
  cache and empty queues; instance-seconds against the best fixed split over the same span.
"""

from __future__ import annotations

import argparse
import time

from halfmoon.cli.sim import DEFAULT_TRACE
from halfmoon.policy.state import SLO
from halfmoon.sim.config import SimConfig
from halfmoon.sim.plan import DISAGGREGATED, Candidate, Layout, PlanSettings, plan, simulator, window
from halfmoon.sim.profile import load_profile
from halfmoon.sim.trace import TraceRequest, load_trace

SPEED_WINDOW = 10_000


def settings(profile, **kw) -> PlanSettings:
    return PlanSettings(SimConfig(slo=SLO(ttft_s=30.0, tbt_s=0.1)), target=0.9,
                        pool_blocks_per_node=profile.dram_cache_tokens_per_node // 512, **kw)


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _row(c: Candidate) -> str:
    return (f"| {c.layout.label} | {c.layout.instances} | {c.attainment:.1%} | {c.goodput_rps:.2f} "
            f"| {c.ttft_p90_s:.2f} | {c.tbt_p90_s * 1000:.0f} |")


def speed(profile, trace: list[TraceRequest]) -> None:
    part = window(trace, 0, SPEED_WINDOW)
    result, wall, cpu = _timed(lambda: plan(profile, part, settings(profile)))
    print(f"### speed: {len(part):,} requests, {len(result.candidates)} layouts simulated")
    print(f"wall {wall:.1f} s, CPU {cpu:.1f} s ({cpu / len(result.candidates):.2f} CPU s a layout)")
    print("| layout | instances | attainment | goodput (req/s) | TTFT p90 (s) | TBT p90 (ms) |\n|---|---:|---:|---:|---:|---:|")
    for c in result.candidates:
        print(_row(c))
    print(result.reason, "\n")


def grid(profile, trace: list[TraceRequest], most: int) -> int:
    ours = settings(profile, aggregated=False)
    evaluate = simulator(profile, trace, ours)
    layouts = [Layout(DISAGGREGATED, p, d) for p in range(1, most) for d in range(1, most - p + 1)]
    tried, wall, cpu = _timed(lambda: [evaluate(lay) for lay in layouts])
    feasible = [c for c in tried if c.meets]
    best = min(feasible, key=lambda c: (c.layout.instances, -c.attainment), default=None)
    print(f"### grid: every P + D <= {most}, {len(trace):,} requests: {len(layouts)} layouts, "
          f"wall {wall:.1f} s, CPU {cpu:.1f} s")
    print("best fixed split:", "none" if best is None else _row(best))
    for name, kw in (("planner, disaggregated", {"aggregated": False}),
                     ("planner, + aggregated + CPP 2,4", {"cpp_stages": (2, 4)})):
        result, wall, cpu = _timed(lambda kw=kw: plan(profile, trace, settings(profile, **kw)))
        print(f"{name}: {len(result.candidates)} layouts, wall {wall:.1f} s, CPU {cpu:.1f} s; "
              + ("none" if result.choice is None else _row(result.choice)))
    print()
    return 0 if best is None else best.layout.instances


def windows(profile, trace: list[TraceRequest], count: int, fixed: int) -> None:
    size = len(trace) // count
    print(f"### windows: {count} x {size:,} requests, planned one by one")
    print("| window | span (s) | choice | instances | attainment |\n|---|---:|---|---:|---:|")
    planned = span_total = 0.0
    for i in range(count):
        part = window(trace, i * size, size)
        # the window lasts until the next one's first arrival (the last one until its own last arrival)
        end = trace[(i + 1) * size].arrival_s if (i + 1) * size < len(trace) else trace[-1].arrival_s
        span = end - trace[i * size].arrival_s
        result = plan(profile, part, settings(profile))
        c = result.choice
        print(f"| {i} | {span:.0f} | {'none' if c is None else c.layout.label} "
              f"| {'-' if c is None else c.layout.instances} | {'-' if c is None else f'{c.attainment:.1%}'} |")
        if c is not None:
            planned += c.layout.instances * span
        span_total += span
    print(f"instance-seconds: planned {planned:,.0f}, best fixed split {fixed * span_total:,.0f} "
          f"({planned / (fixed * span_total):.2f}x)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--grid", type=int, default=8, help="largest P + D of the grid")
    parser.add_argument("--windows", type=int, default=12)
    args = parser.parse_args()
    profile = load_profile()
    trace = load_trace(DEFAULT_TRACE)
    speed(profile, trace)
    fixed = grid(profile, trace, args.grid)
    if fixed:
        windows(profile, trace, args.windows, fixed)


if __name__ == "__main__":
    main()
