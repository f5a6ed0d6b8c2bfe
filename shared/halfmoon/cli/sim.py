"""`halfmoon sim`: replay a request trace on a simulated cluster running the Conductor's policies."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

DEFAULT_TRACE = Path(__file__).resolve().parents[4] / "shared" / "data" / "mooncake-traces" / "conversation_trace.jsonl"


def _pool(value: str) -> str | int | None:
    if value in ("default", "unbounded"):
        return value
    try:
        blocks = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"pool must be an integer, 'default' or 'unbounded', got {value!r}") from None
    if blocks < 0:
        raise argparse.ArgumentTypeError("pool must be >= 0 blocks")
    return blocks


def register(subparsers: argparse._SubParsersAction) -> None:
    from halfmoon.policy.admission import ADMISSION_POLICIES, OVERLOAD_WAIT_S
    from halfmoon.policy.eviction import EVICTION_POLICIES
    from halfmoon.policy.prefill import PREFILL_POLICIES
    from halfmoon.sim.config import COUPLED_VARIANTS, MODES

    p = subparsers.add_parser("sim", help="trace-driven cluster simulation", description=__doc__)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="JSONL trace (Mooncake format)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--profile", default="llama3-70b-8xa800", help="bundled profile name or a profile JSON path")
    p.add_argument("--mode", choices=MODES, default="disaggregated",
                   help="mixed: the prefill and decode pools plus --aggregated-nodes, each request handed off "
                        "or served whole by predicted cost")
    p.add_argument("--prefill-nodes", type=int, default=8)
    p.add_argument("--decode-nodes", type=int, default=8)
    p.add_argument("--nodes", type=int, default=16, help="coupled mode: number of prefill+decode nodes")
    p.add_argument("--aggregated-nodes", type=int, default=1, help="mixed mode: nodes that prefill and decode")
    p.add_argument("--handoff-overhead", type=float, default=0.02, metavar="SECONDS",
                   help="mixed mode: the fixed cost of a hand-off, weighed against serving whole")
    p.add_argument("--prefill-policy", choices=sorted(PREFILL_POLICIES), default="global-cache-aware")
    p.add_argument("--admission", choices=sorted(ADMISSION_POLICIES), default="none")
    p.add_argument("--eviction", choices=sorted(EVICTION_POLICIES), default="lru")
    p.add_argument("--overload-wait", type=float, default=OVERLOAD_WAIT_S, metavar="SECONDS",
                   help="a request turned away as overloaded that the conductor expects to let in within this long "
                        "asks again, as the gateway's does (0: rejected at once, as in the paper)")
    p.add_argument("--pool-blocks", type=_pool, default="default",
                   help="KVCache pool capacity in blocks; 'default' = the profile's DRAM per prefill node")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--time-scale", type=float, default=1.0, help="arrival-rate multiplier (2 = twice as fast)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo", type=float, default=30.0, help="seconds")
    p.add_argument("--tbt-slo", type=float, default=0.1, help="seconds")
    p.add_argument("--balancing-threshold", type=float, default=1.0)
    p.add_argument("--coupled-variant", choices=COUPLED_VARIANTS, default="plain")
    p.add_argument("--coupled-router", choices=sorted(PREFILL_POLICIES), default=None,
                   help="default: local-cache-aware for the prefix variant, load-balancing otherwise")
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--cpp", type=int, default=0, metavar="STAGES",
                   help="chunked pipeline-parallel prefill over STAGES prefill nodes for long prompts (0 = off)")
    p.add_argument("--cpp-chunk-tokens", type=int, default=4096, help="CPP chunk size in tokens")
    p.add_argument("--cpp-min-tokens", type=int, default=32768, help="shortest prompt CPP is considered for")
    p.add_argument("--cpp-hop-bytes", type=int, default=16384,
                   help="hidden-state bytes per token passed between CPP stages (hidden size x dtype bytes)")
    p.add_argument("--cpp-when-slower-than", type=float, default=0.0, metavar="SECONDS",
                   help="pipeline only prompts whose best single node would take at least this long "
                        "(0: whenever a pipeline is faster)")
    p.add_argument("--max-scale", action="store_true",
                   help="also search the largest time scale keeping >= 90%% of requests within both SLOs")
    p.add_argument("--json", type=Path, default=None, help="write the summary as JSON here")
    p.set_defaults(func=main)


def build_config(args: argparse.Namespace, dram_tokens_per_node: int):
    from halfmoon.policy.state import SLO
    from halfmoon.sim.config import SimConfig

    coupled = args.mode == "coupled"
    prefill_nodes = args.nodes if coupled else args.prefill_nodes
    if args.pool_blocks == "default":
        pool = prefill_nodes * (dram_tokens_per_node // args.block_size)
    else:
        pool = None if args.pool_blocks == "unbounded" else args.pool_blocks
    router = args.coupled_router or ("local-cache-aware" if args.coupled_variant == "prefix" else "load-balancing")
    return SimConfig(
        mode=args.mode, prefill_nodes=prefill_nodes, decode_nodes=0 if coupled else args.decode_nodes,
        prefill_policy=args.prefill_policy, admission=args.admission, eviction=args.eviction, pool_blocks=pool,
        block_size=args.block_size, time_scale=args.time_scale, seed=args.seed,
        slo=SLO(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo), balancing_threshold=args.balancing_threshold,
        coupled_variant=args.coupled_variant, coupled_router=router, chunk_tokens=args.chunk_tokens,
        cpp_stages=args.cpp, cpp_chunk_tokens=args.cpp_chunk_tokens, cpp_min_tokens=args.cpp_min_tokens,
        cpp_hop_bytes_per_token=args.cpp_hop_bytes, cpp_min_single_ttft_s=args.cpp_when_slower_than,
        aggregated_nodes=args.aggregated_nodes if args.mode == "mixed" else 0, handoff_overhead_s=args.handoff_overhead,
        overload_wait_s=args.overload_wait,
    )


def summary_dict(result, scale: float | None) -> dict:
    s = result.summary
    out = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in s._asdict().items()}
    out.update(
        replicas=[r._asdict() for r in result.replicas], pulled_blocks=result.pulled_blocks,
        wasted_prefill_s=result.wasted_prefill_s, pipelined=result.pipelined, sim_seconds=result.sim_seconds,
        served_whole=None if result.whole is None else int(result.whole.sum()),
        wall_seconds=result.wall_seconds, requests_per_wall_s=s.requests / max(result.wall_seconds, 1e-9),
        config={k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v)
                for k, v in dataclasses.asdict(result.config).items()},
    )
    if scale is not None:
        out["max_scale_at_90pct"] = scale
    return out


def _table(result, scale: float | None):
    from rich.table import Table

    s, ms = result.summary, 1000.0
    table = Table(title=f"halfmoon sim: {result.config.mode} ({s.requests} requests)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("completed / rejected early / rejected late", f"{s.completed} / {s.rejected_early} / {s.rejected_late}"),
        ("waited out an overload (requests)", str(s.waited)),
        ("TTFT mean / p50 / p90 / p99 (s)", f"{s.ttft_mean:.2f} / {s.ttft_p50:.2f} / {s.ttft_p90:.2f} / {s.ttft_p99:.2f}"),
        ("TBT mean / p50 / p90 / p99 (ms)", f"{s.tbt_mean*ms:.0f} / {s.tbt_p50*ms:.0f} / {s.tbt_p90*ms:.0f} / {s.tbt_p99*ms:.0f}"),
        ("cache hit rate (blocks)", f"{s.hit_rate:.1%}"),
        ("prefill compute per request (s)", f"{s.prefill_s_mean:.3f}"),
        ("blocks pulled from remote holders", str(result.pulled_blocks)),
        ("prefill wasted on late rejections (s)", f"{result.wasted_prefill_s:.1f}"),
    ]
    if result.config.cpp_stages:
        rows.append((f"prefilled by a {result.config.cpp_stages}-stage CPP pipeline", str(result.pipelined)))
    if result.whole is not None:
        rows.append(("served whole on an aggregated node", f"{int(result.whole.sum())} ({result.whole.mean():.1%})"))
    rows += [(f"effective capacity, TBT {name} ({thr})", f"{share:.1%}")
             for (name, share), thr in zip(s.capacity.items(), ("100 ms", "200 ms", "300 ms"))]
    rows += [(f"replicas of #{r.rank} hottest block (mean / peak)", f"{r.mean_replicas:.2f} / {r.peak_replicas}")
             for r in result.replicas]
    if scale is not None:
        rows.append((f"max arrival scale with >= 90% effective (TBT {result.config.slo.tbt_s*ms:.0f} ms)", f"{scale:.2f}x"))
    rows.append(("simulated / wall seconds", f"{result.sim_seconds:.0f} / {result.wall_seconds:.1f}"))
    for row in rows:
        table.add_row(*row)
    return table


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from halfmoon.sim.config import SimConfigError
    from halfmoon.sim.profile import ProfileError, load_profile
    from halfmoon.sim.run import max_sustainable_scale, simulate
    from halfmoon.sim.trace import TraceFormatError, load_trace

    console = Console()
    try:
        profile = load_profile(args.profile)
        config = build_config(args, profile.dram_cache_tokens_per_node)
        trace = load_trace(args.trace, args.limit)
    except (FileNotFoundError, TraceFormatError, ProfileError, SimConfigError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("replaying", total=len(trace))
        result = simulate(config, profile, trace, progress=lambda done, total: bar.update(task, completed=done))
        scale = None
        if args.max_scale:
            search = bar.add_task("searching max scale", total=None)
            scale = max_sustainable_scale(config, profile, trace, config.slo.tbt_s,
                                          on_run=lambda s, share: bar.update(search, description=f"scale {s:.2f}: {share:.1%}"))
    console.print(_table(result, scale))
    if args.json is not None:
        args.json.write_text(json.dumps(summary_dict(result, scale), indent=2))
    return 0
