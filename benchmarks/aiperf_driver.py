"""Drive a server with aiperf, the external load generator, and read its per-request records.

aiperf runs from its own virtual environment (`python3.11 -m venv /work/aiperf-venv &&
/work/aiperf-venv/bin/pip install aiperf==0.13.0`); this module only builds its command line and reads
what it exports, so the figures are aiperf's, never Halfmoon's own driver's. Two workloads, as
`benchmarks.peers` names them:

- ``fixed``: a fixed concurrency of equal synthetic prompts with ``ignore_eos``;
- ``trace``: a slice of the Mooncake trace replayed at its own timestamps (``mooncake_trace``,
  ``--fixed-schedule``), each 512-token block of the trace scaled to ``--isl-block-size`` tokens and
  its output capped, so the slice fits these cores.

The summary has the keys `benchmarks.peers` tabulates: throughput, TTFT and ITL percentiles, SLO
attainment, reused prompt tokens, and one outcome per request in request order (``met``, ``missed``,
``rejected``, ``failed``) for the false-rejection pairing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_BLOCK_TOKENS = 512  # the published trace's hash block


@dataclass(frozen=True)
class AiperfLoad:
    """One workload. ``trace_file`` set: a trace replay; else the fixed-concurrency shape."""

    requests: int
    concurrency: int = 0
    isl: int = 0
    osl: int = 0
    warmup: int = 0
    trace_file: Path | None = None
    isl_block_size: int = 16


@dataclass(frozen=True)
class RequestSLO:
    ttft_ms: float
    itl_ms: float


def trace_slice(source: Path, target: Path, offset: int, limit: int, block_size: int, max_output: int,
                speedup: float = 1.0) -> Path:
    """The trace's requests ``[offset, offset + limit)`` with their prompts scaled from 512-token blocks to
    ``block_size`` tokens (the hash ids, which aiperf expands, stay) and outputs capped at ``max_output``;
    timestamps start at 0 and are divided by ``speedup`` (below 1: the same requests spread out)."""
    if speedup <= 0:
        raise ValueError(f"speedup must be positive, got {speedup}")
    rows = [json.loads(line) for line in source.read_text().splitlines()[offset:offset + limit]]
    start = rows[0]["timestamp"] if rows else 0
    scale = block_size / TRACE_BLOCK_TOKENS
    with target.open("w") as out:
        for row in rows:
            out.write(json.dumps({"timestamp": round((row["timestamp"] - start) / speedup),
                                  "input_length": max(1, math.ceil(row["input_length"] * scale)),
                                  "output_length": max(1, min(max_output, row["output_length"])),
                                  "hash_ids": row["hash_ids"]}) + "\n")
    return target


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "config.json", "generation_config.json")


def offline_tokenizer(model_dir: Path, hub_cache: Path) -> str:
    """The model directory's tokenizer laid out as a Hugging Face hub cache entry, and its repo name.
    aiperf's trace replay decodes in worker processes that force offline mode, where a tokenizer loads
    from the hub cache only (a local directory is refused as a repo id), so nothing is downloaded."""
    files = [model_dir / name for name in TOKENIZER_FILES if (model_dir / name).exists()]
    revision = hashlib.sha1(b"".join(f.read_bytes() for f in files)).hexdigest()
    repo = hub_cache / f"models--halfmoon--{model_dir.name}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return f"halfmoon/{model_dir.name}"


def command(aiperf: str, model: str, url: str, tokenizer: str, load: AiperfLoad, artifacts: Path,
            seed: int = 1) -> list[str]:
    """The aiperf command line of the issue's runs (completions, streaming, server token counts)."""
    cmd = [aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
           "--tokenizer", tokenizer, "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
           "--ui", "none", "--random-seed", str(seed), "--artifact-dir", str(artifacts)]
    if load.trace_file is not None:
        return [*cmd, "--input-file", str(load.trace_file), "--custom-dataset-type", "mooncake_trace",
                "--fixed-schedule", "--isl-block-size", str(load.isl_block_size)]
    return [*cmd, "--isl", str(load.isl), "--isl-stddev", "0", "--osl", str(load.osl), "--osl-stddev", "0",
            "--request-count", str(load.requests), "--concurrency", str(load.concurrency),
            *(["--warmup-request-count", str(load.warmup)] if load.warmup else [])]


def run(aiperf: str, model: str, url: str, tokenizer: Path, load: AiperfLoad, artifacts: Path, slo: RequestSLO,
        log: Path) -> dict[str, Any]:
    """Run aiperf once and summarise its records; raises RuntimeError (with the log's path) if it fails.
    ``tokenizer``: the model directory, loaded by aiperf offline from a hub cache beside ``artifacts``."""
    artifacts.mkdir(parents=True, exist_ok=True)
    hub_cache = artifacts.parent / "hf-hub"
    name = offline_tokenizer(tokenizer, hub_cache)
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log.open("ab") as out:
        done = subprocess.run(command(aiperf, model, url, name, load, artifacts), stdout=out,
                              stderr=subprocess.STDOUT, check=False, env=env)
    records = artifacts / "profile_export.jsonl"
    if not records.exists():
        raise RuntimeError(f"aiperf exited with {done.returncode} and wrote no records; see {log}")
    return summarise([json.loads(line) for line in records.read_text().splitlines() if line.strip()], slo)


def _value(record: dict[str, Any], name: str) -> float | None:
    metric = record.get("metrics", {}).get(name)
    return None if metric is None else metric.get("value")


def outcome(record: dict[str, Any], slo: RequestSLO) -> str:
    error = record.get("error")
    if error:
        return "rejected" if error.get("code") == 429 else "failed"
    ttft, itl = _value(record, "time_to_first_token"), _value(record, "inter_token_latency")
    met = ttft is not None and ttft <= slo.ttft_ms and (itl is None or itl <= slo.itl_ms)
    return "met" if met else "missed"


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def spread(values: list[float]) -> float | None:
    """The p50 of ``|v - median| / v``: the relative error of predicting the run's median for every request,
    the error a prediction made request by request has to beat to tell them apart (None: no values)."""
    positive = [v for v in values if v > 0]
    if not positive:
        return None
    middle = statistics.median(positive)
    return statistics.median(abs(v - middle) / v for v in positive)


def summarise(records: list[dict[str, Any]], slo: RequestSLO) -> dict[str, Any]:
    """The profiling phase's figures (warm-up records are left out), requests in the order aiperf issued them."""
    measured = sorted((r for r in records if r.get("metadata", {}).get("benchmark_phase") == "profiling"),
                      key=lambda r: r["metadata"].get("session_num", 0))
    ok = [r for r in measured if not r.get("error")]
    starts = [r["metadata"]["request_start_ns"] for r in measured]
    ends = [r["metadata"]["request_end_ns"] for r in measured]
    duration_s = (max(ends) - min(starts)) / 1e9 if measured else 0.0
    out_tokens = sum(_value(r, "output_token_count") or 0 for r in ok)
    prompt = sum(_value(r, "usage_prompt_tokens") or 0 for r in ok)
    cached = sum(_value(r, "usage_prompt_cache_read_tokens") or 0 for r in ok)
    outcomes = [outcome(r, slo) for r in measured]
    ttfts = [v for r in ok if (v := _value(r, "time_to_first_token")) is not None]
    itls = [v for r in ok if (v := _value(r, "inter_token_latency")) is not None]
    return {
        "tool": "aiperf",
        "requests": len(measured),
        "completed": len(ok),
        "errors": dict(sorted(Counter(str(r["error"].get("code")) for r in measured if r.get("error")).items())),
        "rejected": outcomes.count("rejected"),
        "duration_s": duration_s,
        "output_throughput": out_tokens / duration_s if duration_s else 0.0,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "ttft_ms": percentiles(ttfts),
        "itl_ms": percentiles(itls),
        "ttft_spread": spread(ttfts),
        "itl_spread": spread(itls),
        "goodput": {"met": outcomes.count("met"), "share": outcomes.count("met") / len(measured) if measured else 0.0},
        "cached_prompt_share": cached / prompt if prompt else 0.0,
        "outcomes": outcomes,
    }
