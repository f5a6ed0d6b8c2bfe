"""Regenerate docs/SIMULATION.md and its plots: python -m benchmarks.sim_report

Runs experiments (a)-(e) on the conversation trace plus the two performance benchmarks,
writes docs/sim/*.png, docs/sim/results.json and docs/SIMULATION.md. ``--reuse`` rebuilds the
document from docs/sim/results.json without rerunning anything.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks import sched_latency, sim_cpp, sim_plots, sim_throughput
from benchmarks import sim_experiments as exp
from benchmarks.sim_report_text import render

DOCS = Path(__file__).resolve().parents[1] / "docs"
OUT = DOCS / "sim"


EXPERIMENTS = {name: getattr(exp, f"exp_{name}") for name in ("a", "b", "c", "d", "e")} | {"f": sim_cpp.exp_f}


def collect(names: list[str]) -> dict:
    runner = exp.Runner()
    results: dict = {}
    try:
        for name in names:
            started = time.perf_counter()
            results[name] = EXPERIMENTS[name](runner)
            print(f"experiment ({name}) done in {time.perf_counter() - started:.0f} s", flush=True)
    finally:
        runner.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reuse", action="store_true", help="rebuild the document from docs/sim/results.json")
    parser.add_argument("--only", nargs="+", choices=sorted(EXPERIMENTS), default=None,
                        help="rerun only these experiments, keeping the others' results from docs/sim/results.json")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    results_path = OUT / "results.json"
    started = time.perf_counter()
    if args.reuse:
        results = json.loads(results_path.read_text())
    elif args.only:
        results = json.loads(results_path.read_text()) | collect(args.only)
        results_path.write_text(json.dumps(results, indent=1, default=str))
        results = json.loads(results_path.read_text())
    else:
        results = collect(list(EXPERIMENTS))
        results["sched_latency"] = sched_latency.measure()
        results["throughput"] = sim_throughput.measure()
        results["meta"] = {
            "generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "wall_s": time.perf_counter() - started,
            "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
        }
        results_path.write_text(json.dumps(results, indent=1, default=str))
        results = json.loads(results_path.read_text())
    plots = {
        "a": sim_plots.plot_a(results["a"], OUT),
        "b": sim_plots.plot_b(results["b"], OUT),
        "c": sim_plots.plot_c(results["c"], OUT),
        "d": sim_plots.plot_d(results["d"], OUT),
        "e": sim_plots.plot_e(results["e"], OUT),
    }
    (DOCS / "SIMULATION.md").write_text(render(results, plots))
    print(f"wrote {DOCS / 'SIMULATION.md'} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
