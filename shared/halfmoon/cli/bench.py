"""`halfmoon bench`: drive any OpenAI-compatible endpoint with a fixed concurrency or a Mooncake trace,
and print TTFT, ITL, throughput, goodput and errors (see bench_driver.py for how requests are sent)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_TRACE = "/work/shared/data/mooncake-traces/conversation_trace.jsonl"
PREDICTION_METRIC = "halfmoon_ttft_prediction_error_ratio"
TBT_PREDICTION_METRIC = "halfmoon_tbt_prediction_error_ratio"


def _advance(progress: Any, task: Any) -> Callable[[Any], None]:
    failed = 0

    def done(result: Any) -> None:
        nonlocal failed
        failed += not result.ok
        progress.update(task, advance=1, failed=failed)

    return done


def drive(endpoint: Any, requests: Sequence[Any], concurrency: int, paced: bool, slo: Any, title: str,
          warmup: Sequence[Any] = (), console: Any = None, metrics_url: str | None = None) -> dict[str, Any]:
    """Warm up (unmeasured), then run ``requests`` under a progress bar; returns the run's summary, with the
    TTFT prediction error of the measured requests when ``metrics_url`` names a Halfmoon gateway's /metrics."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from halfmoon.cli.bench_driver import run
    from halfmoon.cli.bench_stats import summarise

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("[red]{task.fields[failed]} failed"))
    with Progress(*columns, console=console) as progress:
        if warmup:
            task = progress.add_task(f"{title}: warm-up", total=len(warmup), failed=0)
            asyncio.run(run(endpoint, warmup, max(1, concurrency), _advance(progress, task)))
        before = scrape_prediction_error(metrics_url) if metrics_url else None
        task = progress.add_task(title, total=len(requests), failed=0)
        outcome = asyncio.run(run(endpoint, requests, concurrency, _advance(progress, task), paced=paced))
    summary = summarise(outcome.results, outcome.duration_s, slo)
    if before is not None and metrics_url:
        summary["prediction_error"] = prediction_error(before, scrape_prediction_error(metrics_url))
    return summary


def scrape_prediction_error(url: str, metric: str = PREDICTION_METRIC) -> dict[str, Any]:
    import httpx

    return parse_prediction_error(httpx.get(url, timeout=10).raise_for_status().text, metric)


def parse_prediction_error(text: str, metric: str = PREDICTION_METRIC) -> dict[str, Any]:
    """A prediction-error histogram (TTFT's by default) in Prometheus text: buckets summed over labels, and
    how many predictions were at or above the delivered figure."""
    from prometheus_client.parser import text_string_to_metric_families

    from halfmoon.cli.bench_stats import Histogram

    buckets, over = [], 0.0
    for family in text_string_to_metric_families(text):
        if family.name == metric:
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    buckets.append((float(s.labels["le"]), s.value))
                elif s.name.endswith("_count") and s.labels.get("direction") == "over":
                    over += s.value
    return {"histogram": Histogram.from_samples(buckets), "over": over}


def prediction_error(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float | None]:
    hist = after["histogram"].minus(before["histogram"])
    count = hist.count
    return {"count": count, "p50": hist.quantile(0.5), "p90": hist.quantile(0.9),
            "over_share": (after["over"] - before["over"]) / count if count else None}


def _fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}{unit}"


def render(summary: dict[str, Any], title: str, console: Any) -> None:
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    errors = ", ".join(f"{status}: {n}" for status, n in summary["errors"].items()) or "none"
    table.add_row("requests (completed / failed)", f"{summary['requests']} ({summary['completed']} / {summary['failed']})")
    table.add_row("errors by status", errors)
    table.add_row("duration", _fmt(summary["duration_s"], " s", 2))
    table.add_row("requests/s", _fmt(summary["request_throughput"], "", 2))
    table.add_row("output tokens/s", _fmt(summary["output_throughput"]))
    for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms")):
        figures = summary[key]
        table.add_row(f"{name} p50 / p90 / p99 (ms)", " / ".join(_fmt(figures[f"p{q}"]) for q in (50, 90, 99)))
    good = summary["goodput"]
    table.add_row(f"goodput (TTFT <= {good['slo_ttft_ms']:g} ms, TPOT <= {good['slo_itl_ms']:g} ms)",
                  f"{_fmt(None if good['share'] is None else 100 * good['share'], '%')} ({good['rate']:.2f} req/s)")
    share = summary["cached_prompt_share"]
    table.add_row("prompt tokens reused (server's count)", _fmt(None if share is None else 100 * share, "%"))
    if (pred := summary.get("prediction_error")) is not None:
        table.add_row("TTFT prediction |error| / delivered, p50 / p90",
                      f"{_fmt(pred['p50'], '', 2)} / {_fmt(pred['p90'], '', 2)} ({pred['count']:.0f} requests)")
    console.print(table)


def _workload(args: argparse.Namespace) -> tuple[list[Any], list[Any], int, bool, str]:
    from halfmoon.cli.bench_workload import (
        TokenRange,
        TraceScaling,
        fixed_requests,
        trace_requests,
    )
    from halfmoon.sim.trace import load_trace

    tokens = TokenRange(*args.token_range)
    warmup = fixed_requests(args.warmup, args.isl, args.osl, tokens, seed=args.seed + 1)
    if args.trace is None:
        concurrency = 8 if args.concurrency is None else args.concurrency
        title = f"fixed concurrency {concurrency}, {args.isl} in / {args.osl} out"
        return warmup, fixed_requests(args.requests, args.isl, args.osl, tokens, args.seed), concurrency, False, title
    trace = load_trace(args.trace, limit=args.offset + args.limit)[args.offset:]
    scaling = TraceScaling(args.isl_block_size, args.osl_scale, args.max_output_tokens, args.speedup, args.seed)
    title = (f"trace {Path(args.trace).name} [{args.offset}:{args.offset + len(trace)}], "
             f"{args.isl_block_size}-token blocks, x{args.speedup:g} speed")
    return warmup, trace_requests(trace, scaling, tokens), args.concurrency or 0, True, title


def first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.get(f"{base_url.rstrip('/')}/models", headers=headers, timeout=30).raise_for_status()
    return reply.json()["data"][0]["id"]


def _bench(args: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console

    from halfmoon.cli.bench_driver import Endpoint
    from halfmoon.cli.bench_stats import SLO

    console = Console()
    try:
        warmup, requests, concurrency, paced, title = _workload(args)
        model = args.model or first_model(args.base_url, args.api_key)
        if args.metrics_url:
            scrape_prediction_error(args.metrics_url)  # a wrong URL fails now, not after the run
    except (ValueError, OSError, httpx.HTTPError) as exc:
        print(f"halfmoon bench: {exc}", file=sys.stderr)
        return 2
    endpoint = Endpoint(args.base_url, model, args.api_key, not args.no_ignore_eos, args.timeout, args.max_backoff_s)
    summary = drive(endpoint, requests, concurrency, paced, SLO(args.slo_ttft_ms, args.slo_itl_ms), title,
                    warmup, console, args.metrics_url)
    render(summary, f"{model} at {args.base_url}: {title}", console)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
        Path(args.json).write_text(json.dumps({"config": {**config, "model": model}, "summary": summary}, indent=2))
    return 0 if summary["completed"] else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="load-test an OpenAI-compatible endpoint (fixed concurrency or a trace)",
                              description=__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="API root, as OpenAI clients take it")
    p.add_argument("--model", help="model name (default: the first the endpoint lists)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--concurrency", type=int, help="requests in flight (default 8; a trace: unbounded)")
    p.add_argument("--requests", type=int, default=48, help="fixed mode: measured requests")
    p.add_argument("--warmup", type=int, default=4, help="unmeasured requests first (isl/osl shaped)")
    p.add_argument("--isl", type=int, default=512, help="fixed mode: prompt tokens")
    p.add_argument("--osl", type=int, default=64, help="fixed mode: output tokens")
    p.add_argument("--trace", nargs="?", const=DEFAULT_TRACE, help=f"replay a Mooncake trace (default {DEFAULT_TRACE})")
    p.add_argument("--offset", type=int, default=0, help="trace: skip this many requests")
    p.add_argument("--limit", type=int, default=64, help="trace: replay this many requests")
    p.add_argument("--isl-block-size", type=int, default=16, help="trace: tokens per 512-token trace block")
    p.add_argument("--speedup", type=float, default=1.0, help="trace: divide arrival times by this")
    p.add_argument("--osl-scale", type=float, default=1.0, help="trace: multiply output lengths by this")
    p.add_argument("--max-output-tokens", type=int, default=0, help="trace: cap output lengths (0: no cap)")
    p.add_argument("--token-range", type=int, nargs=2, default=(100, 2000), metavar=("LOW", "HIGH"),
                   help="prompt token ids are drawn from [LOW, HIGH)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let the model stop early at end-of-sequence")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: TTFT limit")
    p.add_argument("--slo-itl-ms", type=float, default=200.0, help="goodput: mean inter-token latency limit")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--max-backoff-s", type=float, default=30.0,
                   help="fixed mode: a slot answered 429 waits its Retry-After, at most this long, before its "
                        "next request (0: at once)")
    p.add_argument("--metrics-url", help="a Halfmoon gateway's /metrics: report its TTFT prediction error")
    p.add_argument("--json", metavar="FILE", help="also write the configuration and figures as JSON")
    p.set_defaults(func=_bench)
