"""Per-request disaggregation in the simulator, on the conversation trace: when the hand-off wins, when
serving whole does, and what a mixed layout gains over all-P/D and all-aggregated at the same size.

Run: python -m benchmarks.sim_disagg [--sizes 4 6]
Prints markdown tables for docs/BENCHMARKS.md:

- layouts: for each instance count, every P/D split, the aggregated layout `halfmoon plan` tries (prefix
  cache, whole-prompt prefill), and mixed layouts (P + D + 1 or 2 aggregated nodes, chunked prefill with
  an HBM prefix cache), each request handed off or served whole by policy/disaggregation.py;
- bins: for the best mixed layout of each size, by prompt length and by the share of the prompt cached
  where it was served, the share served whole and each option's attainment (TTFT and TBT within SLO).
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from halfmoon.cli.sim import DEFAULT_TRACE
from halfmoon.policy.state import SLO
from halfmoon.sim.config import SimConfig
from halfmoon.sim.engine import SimResult
from halfmoon.sim.metrics import REJECTED_EARLY
from halfmoon.sim.profile import Profile, load_profile
from halfmoon.sim.run import simulate
from halfmoon.sim.trace import TraceRequest, load_trace

SLOS = SLO(ttft_s=30.0, tbt_s=0.1)
LENGTHS = ((0, 2_000), (2_000, 8_000), (8_000, 32_000), (32_000, 10**9))
CACHED = ((0.0, 0.5), (0.5, 0.9), (0.9, 1.01))


def layouts(size: int) -> list[tuple[str, SimConfig]]:
    out = [(f"{p}P+{size - p}D", SimConfig(mode="disaggregated", prefill_nodes=p, decode_nodes=size - p, slo=SLOS))
           for p in range(1, size)]
    out.append((f"{size} aggregated", SimConfig(mode="coupled", prefill_nodes=size, decode_nodes=0, slo=SLOS,
                                                 coupled_variant="prefix", coupled_router="local-cache-aware")))
    for a in (1, 2):
        out += [(f"{p}P+{size - a - p}D+{a}A", SimConfig(mode="mixed", prefill_nodes=p, decode_nodes=size - a - p,
                                                         aggregated_nodes=a, slo=SLOS))
                for p in range(1, size - a)]
    return out


def pooled(config: SimConfig, profile: Profile) -> SimConfig:
    """The KVCache pool as `halfmoon plan` sizes it: each prefill node's DRAM share."""
    per_node = profile.dram_cache_tokens_per_node // config.block_size
    return dataclasses.replace(config, pool_blocks=per_node * config.prefill_nodes)


def attainment(result: SimResult, mask: np.ndarray | None = None) -> float:
    ok = result.outcomes.effective(SLOS.ttft_s, SLOS.tbt_s)
    ok = ok if mask is None else ok[mask]
    return float(ok.mean()) if len(ok) else float("nan")


def layout_table(profile: Profile, trace: list[TraceRequest], size: int) -> tuple[str, SimResult]:
    print(f"#### {size} instances\n")
    print("| layout | attainment | goodput (req/s) | TTFT p90 (s) | TBT p90 (ms) | rejected | served whole |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    best: tuple[float, str, SimResult] | None = None
    for label, config in layouts(size):
        result = simulate(pooled(config, profile), profile, trace)
        share = attainment(result)
        s = result.summary
        good = share * len(trace) / result.sim_seconds
        whole = "-" if result.whole is None else f"{result.whole.mean():.1%}"
        print(f"| {label} | {share:.1%} | {good:.2f} | {s.ttft_p90:.1f} | {s.tbt_p90 * 1000:.0f} "
              f"| {s.rejected_early + s.rejected_late} | {whole} |", flush=True)
        if result.whole is not None and (best is None or share > best[0]):
            best = (share, label, result)
    print()
    assert best is not None
    return best[1], best[2]


def bins_table(label: str, result: SimResult, trace: list[TraceRequest]) -> None:
    assert result.whole is not None
    out = result.outcomes
    length = np.array([r.input_length for r in trace])
    cached = np.where(out.blocks > 0, out.hit_blocks / np.maximum(out.blocks, 1), 0.0)
    print(f"#### {label}: who won, by prompt length and cached share where served\n")
    print("| prompt tokens | cached | requests | served whole | handed off | rejected | attainment whole "
          "| attainment handed off |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for lo, hi in LENGTHS:
        for clo, chi in CACHED:
            mask = (length >= lo) & (length < hi) & (cached >= clo) & (cached < chi)
            if not mask.any():
                continue
            whole = mask & result.whole
            handed = mask & ~result.whole & (out.status != REJECTED_EARLY)

            def cell(m: np.ndarray) -> str:
                return f"{attainment(result, m):.1%}" if m.any() else "-"

            upper = f"{hi:,}" if hi < 10**9 else "max"
            n = int(mask.sum())
            print(f"| {lo:,}-{upper} | {clo:.0%}-{min(chi, 1.0):.0%} | {n:,} | {whole.sum() / n:.1%} "
                  f"| {handed.sum() / n:.1%} | {(mask & (out.status == REJECTED_EARLY)).sum() / n:.1%} "
                  f"| {cell(whole)} | {cell(handed)} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 6])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    args = parser.parse_args()
    profile, trace = load_profile(), load_trace(args.trace)
    print(f"### Per-request disaggregation: conversation trace ({len(trace):,} requests), TTFT {SLOS.ttft_s:g} s, "
          f"TBT {SLOS.tbt_s * 1000:g} ms\n")
    best = [layout_table(profile, trace, size) for size in args.sizes]
    for label, result in best:
        bins_table(label, result, trace)


if __name__ == "__main__":
    main()
