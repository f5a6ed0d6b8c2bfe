"""Experiment (f) of docs/SIMULATION.md: chunked pipeline-parallel prefill (CPP) on the conversation trace.

Run alone (merging into docs/sim/results.json and redrawing the document):
``python -m benchmarks.sim_report --only f``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.sim_experiments import LONG_PROMPT, Runner, halfmoon
from halfmoon.policy.cpp import CppSettings

DEFAULTS = CppSettings()
CPP_RUNS = {
    "no CPP (single-node prefill)": {},
    "CPP, 2 stages": {"cpp_stages": 2},
    "CPP, 4 stages": {"cpp_stages": 4},
    "CPP, 8 stages": {"cpp_stages": 8},
    "CPP, 4 stages, prompts >= 96k tokens only": {"cpp_stages": 4, "cpp_min_tokens": 98_304},
}


def exp_f(r: Runner) -> dict[str, Any]:
    """Halfmoon 8P+8D with and without CPP; the policy pipelines a prompt of at least
    ``min_tokens`` when its cost model predicts a lower TTFT than the best single node."""
    return dict(zip(CPP_RUNS, r.runs([halfmoon(**kw) for kw in CPP_RUNS.values()])))


def _row(name: str, run: dict) -> list[Any]:
    s, long = run["summary"], run["long"]
    return [
        name, f"{s['completed']:,}", s["rejected_early"] + s["rejected_late"], f"{run['capacity_at_slo']:.1%}",
        f"{s['ttft_mean']:.2f}", f"{s['ttft_p99']:.2f}", run["pipelined"],
        f"{long['within_slo']} / {long['count']}", f"{long['ttft_mean']:.1f}" if long["within_slo"] else "-",
        f"{long['ttft_max']:.1f}" if long["within_slo"] else "-",
    ]


def section_f(f: dict, table: Callable[[list[str], list[list[Any]]], str]) -> str:
    base = f["no CPP (single-node prefill)"]
    four = f["CPP, 4 stages"]
    headers = ["system", "completed", "rejected", "effective (TTFT 30 s, TBT 100 ms)", "avg TTFT (s)", "p99 TTFT (s)",
               "pipelined", f"prompts >= {LONG_PROMPT:,} tokens within 30 s", "their avg TTFT (s)",
               "their max TTFT (s)"]
    return "\n".join([
        "## (f) Chunked pipeline-parallel prefill (CPP) — paper section 5.1",
        "Halfmoon 8P+8D as above, with the Conductor allowed to prefill a long prompt on a pipeline of prefill nodes",
        "(`halfmoon sim --cpp STAGES`). The prompt is cut into chunks of "
        f"{DEFAULTS.chunk_tokens:,} tokens; each stage holds 1/k of the layers, so a chunk's",
        "time on a stage is the cost model's time for that chunk (on top of the tokens before it) divided by k, and each",
        f"hop between stages moves the chunk's hidden states ({DEFAULTS.hop_bytes_per_token:,} bytes a token: d = 8192 in",
        "BF16) at the profile's transfer bandwidth and latency. Each stage pulls its 1/k share of the reused prefix. The",
        "policy (`shared/halfmoon/policy/cpp.py`, called by `KVCentricScheduler`) takes the single-node choice and the",
        f"k - 1 least-loaded other nodes, and pipelines prompts of at least {DEFAULTS.min_tokens:,} tokens when the predicted",
        "TTFT (wait for the busiest stage + prefix pulls + pipeline time) beats the single node's. A pipeline holds all",
        "its stages from start to end (a stage's idle gaps are not lent to other requests).",
        table(headers, [_row(name, run) for name, run in f.items()]),
        "",
        f"Without CPP the {base['long']['count']} prompts of {LONG_PROMPT:,} tokens or more are rejected up front"
        f" ({base['summary']['rejected_early'] + base['summary']['rejected_late']} rejections in all); with a"
        f" 4-stage pipeline {four['long']['within_slo']} of them are served within 30 s (mean"
        f" {four['long']['ttft_mean']:.1f} s), and effective capacity goes from {base['capacity_at_slo']:.1%} to"
        f" {four['capacity_at_slo']:.1%}.",
        "The price is the other requests' wait: a pipeline occupies k prefill nodes, so the average and p99 TTFT rise",
        "(averages count only served requests, so the baseline's mean also excludes the longest prompts it rejected).",
        "Restricting CPP to the prompts that need it (the last row) keeps most of that wait off the rest.",
    ])
