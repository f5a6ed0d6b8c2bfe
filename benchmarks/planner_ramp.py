"""The online planner against fixed layouts on one load ramp (low, high, low), driven by aiperf.

    python -m benchmarks.planner_ramp [--fixed 1,2,3] [--max-instances 3] [--json FILE]

Each configuration is `halfmoon up --aggregated N` on the tiny random model, one after another, and gets the
same ramp: a trace of equal, unshared prompts replayed by aiperf at fixed times (`mooncake_trace`,
`--fixed-schedule`), at ``--low-rps`` for ``--low-s``, ``--high-rps`` for ``--high-s``, then ``--low-rps``
for ``--tail-s``. The planner's configuration is `--aggregated 1 --planner`, at most ``--max-instances``.

An instance's capacity is set by configuration, not by these cores: every engine runs one sequence at a time
(`HALFMOON_MAX_NUM_SEQS=1`). A calibration burst, run first, measures the requests per second one instance
serves; the planner's cost profile is built from it (a step is one request's share of that time, ``b``
sequences take ``b`` steps) with a TBT SLO of 1.5 steps, so it sizes the pools to one sequence per instance.
``--high-rps`` unset, the ramp's high rate is ``--overload`` times the calibrated rate, so the ramp
overloads one instance on any CPU. The conductors
admit everything (TTFT and TBT SLOs out of reach), so the figures are about the pools' size, not admission.

Per configuration: requests within the SLOs (TTFT ``--slo-ttft-ms``, mean ITL ``--slo-itl-ms``, judged per
request on aiperf's records; an error is a miss), and engine instance-seconds over the ramp (engine processes
alive, sampled every 0.5 s, starting ones included).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from benchmarks import aiperf_driver
from benchmarks.peer_servers import HalfmoonServer
from halfmoon.cli.bench import first_model

# the conductors' SLOs out of reach: every request is admitted, whatever the layout
ADMIT_ALL = {"TTFT_SLO_S": "86400", "TBT_SLO_S": "3600", "MAX_NUM_SEQS": "1"}
ENGINE_MODULE = "halfmoon.services.aggregated"


def one_at_a_time_profile(step_s: float) -> dict[str, Any]:
    """A cost profile of engines that run one sequence at a time, each step ``step_s`` (what calibration
    measured): ``b`` sequences take ``b`` times as long, so the planner, given a TBT SLO of 1.5 steps, sizes
    the pools to one sequence per instance, as ``HALFMOON_MAX_NUM_SEQS=1`` makes them run
    (format: docs/SIMULATION.md)."""
    return {
        "name": "one-sequence-per-instance",
        "layers": 4,
        "kv_bytes_per_token": 4096,
        "decode_capacity_tokens": 1_000_000,
        "dram_cache_tokens_per_node": 1_000_000,
        "hbm_cache_tokens_per_node": 1_000_000,
        "prefill": {"samples": [[n, p, step_s * (1 + n / 512)] for n in (1, 16, 64, 256, 1024) for p in (0, 64)]},
        "decode": {"samples": [[b, c, step_s * b] for b in (1, 2, 4, 8, 16) for c in (100, 1000, 10000)]},
        "transfer": {"bandwidth_bytes_per_s": 1e10, "latency_s": 0.0001},
    }


def ramp_trace(path: Path, phases: list[tuple[float, float]], prompt_tokens: int, output_tokens: int,
               block_tokens: int) -> int:
    """A Mooncake-format trace of ``(rate, seconds)`` phases, requests evenly spaced within each; every
    request's hash ids are its own (no prefix shared). Returns the number of requests."""
    blocks = max(1, prompt_tokens // block_tokens)
    rows, t, next_hash = [], 0.0, 0
    for rate, seconds in phases:
        end = t + seconds
        while t < end:
            rows.append({"timestamp": round(t * 1000), "input_length": blocks * block_tokens,
                         "output_length": output_tokens, "hash_ids": list(range(next_hash, next_hash + blocks))})
            next_hash += blocks
            t += 1.0 / rate
        t = end
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


class EngineCensus:
    """Samples how many engine processes run under a server's process tree, and integrates it."""

    def __init__(self, root_pid: int, period_s: float = 0.5) -> None:
        self.root = psutil.Process(root_pid)
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def count(self) -> int:
        engines = 0
        for proc in self.root.children(recursive=True):
            try:
                engines += ENGINE_MODULE in " ".join(proc.cmdline())
            except psutil.Error:
                continue
        return engines

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append((time.monotonic(), self.count()))

    def __enter__(self) -> EngineCensus:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def instance_seconds(self) -> float:
        return sum(n * (t1 - t0) for (t0, n), (t1, _) in zip(self.samples, self.samples[1:]))

    def most(self) -> int:
        return max((n for _, n in self.samples), default=0)


def planner_actions(run_dir: Path) -> list[str]:
    log = run_dir / "logs" / "planner.log"
    return [line.split(" ", 1)[1] for line in log.read_text().splitlines() if "->" in line] if log.exists() else []


def measure(name: str, up_args: list[str], args: argparse.Namespace, model: Path, run_dir: Path, trace: Path,
            requests: int, slo: aiperf_driver.RequestSLO, console: Console) -> dict[str, Any]:
    server = HalfmoonServer(model, run_dir, name=name, up_args=up_args, settings=ADMIT_ALL)
    with console.status(f"{name}: starting"):
        server.start()
    try:
        assert server.proc is not None
        load = aiperf_driver.AiperfLoad(requests=requests, trace_file=trace, isl_block_size=args.block_tokens)
        with console.status(f"{name}: the ramp ({requests} requests)"), EngineCensus(server.proc.pid) as census:
            summary = aiperf_driver.run(args.aiperf, first_model(server.base_url, None), server.base_url.removesuffix("/v1"),
                                        model, load, run_dir / f"{name}-aiperf", slo, run_dir / f"{name}-aiperf.log")
    finally:
        server.stop()
    figures = {"name": name, "up_args": up_args, "met": summary["goodput"]["met"], "requests": summary["requests"],
               "attainment": summary["goodput"]["share"], "instance_seconds": census.instance_seconds(),
               "most_instances": census.most(), "ttft_ms": summary["ttft_ms"], "itl_ms": summary["itl_ms"],
               "errors": summary["errors"]}
    if "--planner" in up_args:
        figures["decisions"] = planner_actions(run_dir / f"{name}-run")
    console.print(f"{name}: {figures['met']}/{figures['requests']} within the SLOs, "
                  f"{figures['instance_seconds']:.0f} instance-s, at most {figures['most_instances']} instances")
    return figures


def calibrate(args: argparse.Namespace, model: Path, run_dir: Path, console: Console) -> float:
    """Requests per second one instance serves back to back: a burst at a fixed concurrency of 4."""
    server = HalfmoonServer(model, run_dir, name="calibration", up_args=["--aggregated", "1"], settings=ADMIT_ALL)
    with console.status("calibration: one instance's rate"):
        server.start()
        try:
            load = aiperf_driver.AiperfLoad(requests=24, concurrency=4, isl=args.prompt_tokens,
                                            osl=args.output_tokens, warmup=2)
            summary = aiperf_driver.run(args.aiperf, first_model(server.base_url, None), server.base_url.removesuffix("/v1"),
                                        model, load, run_dir / "calibration-aiperf", aiperf_driver.RequestSLO(1e9, 1e9),
                                        run_dir / "calibration-aiperf.log")
        finally:
            server.stop()
    rate = float(summary["request_throughput"])
    console.print(f"calibration: one instance served {rate:.2f} requests/s")
    return rate


def report(results: list[dict[str, Any]], target: float, console: Console) -> None:
    fixed = [r for r in results if "decisions" not in r]
    meeting = [r for r in fixed if r["attainment"] >= target]
    best = (min(meeting, key=lambda r: r["instance_seconds"]) if meeting
            else max(fixed, key=lambda r: r["attainment"]) if fixed else None)
    table = Table(title=f"planner ramp (aiperf); best fixed: the cheapest meeting {target:.0%}, else the highest")
    for column in ("configuration", "within SLOs", "attainment", "instance-s", "most instances",
                   "TTFT p50 / p90 (ms)", "ITL p50 (ms)", "instance-s / best fixed"):
        table.add_column(column)
    for r in results:
        ratio = f"{r['instance_seconds'] / best['instance_seconds']:.2f}x" if best else "-"
        ttft = r["ttft_ms"]
        table.add_row(r["name"], f"{r['met']}/{r['requests']}", f"{r['attainment']:.0%}",
                      f"{r['instance_seconds']:.0f}", str(r["most_instances"]),
                      f"{_ms(ttft['p50'])} / {_ms(ttft['p90'])}", _ms(r["itl_ms"]["p50"]),
                      ratio + (" (best fixed)" if r is best else ""))
    console.print(table)
    for r in results:
        for line in r.get("decisions", []):
            console.print(f"  {r['name']}: {line}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: a tiny random model written to the run dir)")
    parser.add_argument("--aiperf", default="/work/aiperf-venv/bin/aiperf", help="aiperf, in its own venv")
    parser.add_argument("--fixed", default="1,2,3", help="fixed aggregated instance counts to compare")
    parser.add_argument("--max-instances", type=int, default=3, help="the planner's bound")
    parser.add_argument("--interval", type=float, default=2.0, help="the planner's decision interval (s)")
    parser.add_argument("--low-rps", type=float, default=0.3)
    parser.add_argument("--high-rps", type=float, help="default: --overload times one instance's rate")
    parser.add_argument("--overload", type=float, default=2.0)
    parser.add_argument("--low-s", type=float, default=30.0)
    parser.add_argument("--high-s", type=float, default=45.0)
    parser.add_argument("--tail-s", type=float, default=60.0)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=200.0)
    parser.add_argument("--target", type=float, default=0.9, help="attainment the best fixed layout must reach")
    parser.add_argument("--run-dir", help="logs and aiperf artifacts (default: a temporary directory)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    console = Console()
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="planner-ramp-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else run_dir / "tiny-model"
    if not (model / "config.json").exists():
        from halfmoon.cli.model_tools import make_tiny_model

        make_tiny_model(model)
    rate = calibrate(args, model, run_dir, console)
    high = args.high_rps or args.overload * rate
    phases = [(args.low_rps, args.low_s), (high, args.high_s), (args.low_rps, args.tail_s)]
    trace = run_dir / "ramp.jsonl"
    requests = ramp_trace(trace, phases, args.prompt_tokens, args.output_tokens, args.block_tokens)
    console.print(f"ramp: {args.low_rps} req/s for {args.low_s:.0f} s, {high:.2f} for {args.high_s:.0f} s, "
                  f"{args.low_rps} for {args.tail_s:.0f} s: {requests} requests; logs in {run_dir}")
    profile = run_dir / "planner-profile.json"
    step_s = 1.0 / (rate * args.output_tokens)
    profile.write_text(json.dumps(one_at_a_time_profile(step_s)))
    slo = aiperf_driver.RequestSLO(args.slo_ttft_ms, args.slo_itl_ms)
    configurations = [(f"fixed {n}", ["--aggregated", n]) for n in args.fixed.split(",")]
    configurations.append(("planner", ["--aggregated", "1", "--planner", "--planner-profile", str(profile),
                                       "--planner-interval", str(args.interval),
                                       "--planner-max-instances", str(args.max_instances),
                                       "--planner-tbt-slo", f"{1.5 * step_s:.4f}",
                                       "--planner-ttft-slo", str(args.slo_ttft_ms / 1000)]))
    results = [measure(name, up_args, args, model, run_dir, trace, requests, slo, console)
               for name, up_args in configurations]
    report(results, args.target, console)
    if args.json:
        Path(args.json).write_text(json.dumps({"ramp": {"phases": phases, "requests": requests}, "results": results},
                                              indent=2))


if __name__ == "__main__":
    main()
