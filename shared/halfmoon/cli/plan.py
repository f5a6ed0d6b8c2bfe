"""`halfmoon plan`: the fewest instances that serve a trace within the SLOs, found with the simulator."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from halfmoon.cli.sim import DEFAULT_TRACE

if TYPE_CHECKING:
    from halfmoon.sim.plan import Plan


def _stages(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"CPP stages must be integers separated by commas, got {value!r}") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    from halfmoon.policy.admission import ADMISSION_POLICIES
    from halfmoon.policy.eviction import EVICTION_POLICIES
    from halfmoon.policy.prefill import PREFILL_POLICIES
    from halfmoon.sim.config import COUPLED_VARIANTS

    p = subparsers.add_parser("plan", help="size prefill/decode/aggregated pools to SLOs with the simulator",
                              description=__doc__)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="JSONL trace (Mooncake format)")
    source.add_argument("--spans", type=Path, default=None,
                        help="the span file a deployment wrote (.halfmoon/traces.jsonl): plan for the requests it "
                             "served (no prefix reuse is known from spans)")
    p.add_argument("--offset", type=int, default=0, help="first request of the window")
    p.add_argument("--limit", type=int, default=None, help="requests in the window (default: to the end)")
    p.add_argument("--time-scale", type=float, default=1.0, help="arrival-rate multiplier (2 = twice as fast)")
    p.add_argument("--ttft-slo", type=float, default=30.0, help="seconds")
    p.add_argument("--tbt-slo", type=float, default=0.1, help="seconds (mean of a request's slowest 10%% intervals)")
    p.add_argument("--target", type=float, default=0.9, help="share of requests within both SLOs, in (0, 1]")
    p.add_argument("--max-instances", type=int, default=64, help="largest layout to consider")
    p.add_argument("--cpp", type=_stages, default=(), metavar="STAGES[,STAGES]",
                   help="also try CPP with these stage counts, for prompts one node would serve past the TTFT SLO")
    p.add_argument("--no-aggregated", action="store_true", help="only disaggregated layouts")
    p.add_argument("--no-disaggregated", action="store_true", help="only aggregated layouts")
    p.add_argument("--aggregated-variant", choices=COUPLED_VARIANTS, default="prefix",
                   help="how an aggregated instance mixes prefill and decode (see docs/SIMULATION.md)")
    p.add_argument("--profile", default="llama3-70b-8xa800", help="bundled profile name or a profile JSON path")
    p.add_argument("--prefill-policy", choices=sorted(PREFILL_POLICIES), default="global-cache-aware")
    p.add_argument("--admission", choices=sorted(ADMISSION_POLICIES), default="none")
    p.add_argument("--eviction", choices=sorted(EVICTION_POLICIES), default="lru")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--plot", type=Path, default=Path("plan.png"), help="where to write the figure")
    p.add_argument("--json", type=Path, default=None, help="write the candidates and the choice as JSON here")
    p.set_defaults(func=main)


def _table(result: Plan, target: float):
    from rich.table import Table

    table = Table(title=f"halfmoon plan: {result.requests:,} requests, target {target:.1%}")
    for name, justify in (("layout", "left"), ("instances", "right"), ("attainment", "right"),
                          ("goodput (req/s)", "right"), ("TTFT p90 (s)", "right"), ("TBT p90 (ms)", "right"),
                          ("rejected", "right"), ("meets", "center"), ("chosen", "center")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for c in sorted(result.candidates, key=lambda c: (c.layout.instances, c.layout.mode, c.layout.prefill)):
        chosen = result.choice is not None and c.layout == result.choice.layout
        table.add_row(c.layout.label, str(c.layout.instances),
                      f"{c.attainment:.1%}", f"{c.goodput_rps:.2f}", f"{c.ttft_p90_s:.2f}",
                      f"{c.tbt_p90_s * 1000:.0f}", str(c.rejected), "yes" if c.meets else "no",
                      "<-" if chosen else "", style="bold green" if chosen else None)
    return table


def write_plot(result: Plan, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, marker in (("disaggregated", "o"), ("aggregated", "s")):
        for cpp in sorted({c.layout.cpp_stages for c in result.candidates if c.layout.mode == mode}):
            ours = [c for c in result.candidates if c.layout.mode == mode and c.layout.cpp_stages == cpp]
            ax.scatter([c.layout.instances for c in ours], [c.attainment for c in ours], marker=marker,
                       label=mode + (f", CPP {cpp} stages" if cpp else ""))
            for c in ours:
                ax.annotate(c.layout.label, (c.layout.instances, c.attainment), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
    if result.choice is not None:
        ax.scatter([result.choice.layout.instances], [result.choice.attainment], s=200, facecolors="none",
                   edgecolors="red", label=f"choice: {result.choice.layout.label}")
    ax.axhline(target, color="gray", linestyle="--", label=f"target {target:.0%}")
    ax.set_xlabel("instances")
    ax.set_ylabel("requests within both SLOs")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"halfmoon plan: candidates simulated ({result.requests:,} requests)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from halfmoon.cli.trace_sources import JsonlSource, TraceSourceError, logged_requests
    from halfmoon.policy.state import SLO
    from halfmoon.sim.config import SimConfig
    from halfmoon.sim.plan import PlanSettings, plan, plan_json, window
    from halfmoon.sim.profile import load_profile
    from halfmoon.sim.trace import load_trace

    console = Console()
    try:
        profile = load_profile(args.profile)
        base = SimConfig(prefill_policy=args.prefill_policy, admission=args.admission, eviction=args.eviction,
                         block_size=args.block_size, time_scale=args.time_scale,
                         slo=SLO(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo))
        settings = PlanSettings(base, target=args.target, max_instances=args.max_instances,
                                pool_blocks_per_node=profile.dram_cache_tokens_per_node // args.block_size,
                                disaggregated=not args.no_disaggregated, aggregated=not args.no_aggregated,
                                aggregated_variant=args.aggregated_variant, cpp_stages=args.cpp)
        if args.spans is not None:
            logged, skipped = logged_requests(JsonlSource(args.spans).spans(), args.block_size)
            if skipped:
                console.print(f"{skipped} logged requests lack a prompt or output length and are left out")
            trace = window(logged, args.offset, args.limit)
        else:
            limit = None if args.limit is None else args.offset + args.limit
            trace = window(load_trace(args.trace, limit), args.offset, args.limit)
    except (FileNotFoundError, TraceSourceError, ValueError) as exc:  # every settings and format error is one
        console.print(f"[red]error:[/red] {exc}")
        return 2
    with console.status(f"simulating layouts for {len(trace):,} requests"):
        result = plan(profile, trace, settings)
    console.print(_table(result, args.target))
    console.print(("[green]choice:[/green] " if result.choice is not None else "[red]no choice:[/red] ")
                  + result.reason)
    console.print(f"{len(result.candidates)} layouts simulated in {result.wall_s:.1f} s")
    write_plot(result, args.target, args.plot)
    console.print(f"plot written to {args.plot}")
    if args.json is not None:
        args.json.write_text(json.dumps(plan_json(result), indent=2))
    return 0
