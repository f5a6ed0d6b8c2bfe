"""Control-plane overhead: TTFT and per-token latency through the live services against the
engine called in one process, same model, same prompts, same run.

    python -m benchmarks.control_plane [--model DIR] [--requests 30] [--tokens 32]

Requests go one at a time (no queueing), so the difference is what NATS, the gateway, the
conductor, the KV hand-off and streaming add. Prints p50/p99 of both and of the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from itertools import pairwise
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import track
from rich.table import Table

from halfmoon.deploy.local import LocalCluster
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.protocol.sampling import SamplingParams


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def engine_latencies(engine: LLMEngine, prompt: list[int], tokens: int) -> tuple[float, list[float]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(f"b{start}", prompt, params)
    stamps = []
    while engine.has_unfinished():
        if engine.step():
            stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in pairwise(stamps)]


def service_latencies(client: httpx.Client, model: str, prompt: list[int], tokens: int) -> tuple[float, list[float]]:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    stamps = []
    with client.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in pairwise(stamps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from halfmoon.cli.model_tools import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny-llama"))
        # Requests go one at a time, so prefill and decode never compute together: give each engine
        # all the cores, as the in-process engine has.
        cluster = LocalCluster(model, Path(tmp) / "run", gateway_port=0, namespace="bench",
                               env={"OMP_NUM_THREADS": str(os.cpu_count() or 1)})
        cluster.start()
        try:
            engine = LLMEngine(EngineConfig(model=model))
            rng = random.Random(0)
            prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(args.prompt_tokens)]
                       for _ in range(args.requests)]
            with httpx.Client(base_url=cluster.url, timeout=120) as client:
                name = client.get("/v1/models").json()["data"][0]["id"]
                for prompt in prompts[:10]:  # warm-up: imports, connections, allocator, per-thread kernel caches
                    service_latencies(client, name, prompt, args.tokens)
                    engine_latencies(engine, prompt, args.tokens)
                local, live = [], []
                # Interleaved, so noise from other work on the machine hits both sides alike.
                for prompt in track(prompts, description="engine, then services, per prompt"):
                    local.append(engine_latencies(engine, prompt, args.tokens))
                    live.append(service_latencies(client, name, prompt, args.tokens))
        finally:
            cluster.stop()
    table = Table(title=f"Control-plane overhead ({args.requests} requests, {args.prompt_tokens}-token prompts, "
                        f"{args.tokens} output tokens, one at a time)")
    for column in ("metric", "engine p50", "engine p99", "services p50", "services p99", "added p50", "added p99"):
        table.add_column(column, justify="right")
    ttft_local, ttft_live = [t for t, _ in local], [t for t, _ in live]
    added = [b - a for a, b in zip(ttft_local, ttft_live)]
    tbt_local = [statistics.mean(g) for _, g in local]
    tbt_live = [statistics.mean(g) for _, g in live]
    tbt_added = [b - a for a, b in zip(tbt_local, tbt_live)]
    for name, a, b, d in (("TTFT (ms)", ttft_local, ttft_live, added), ("per-token (ms)", tbt_local, tbt_live, tbt_added)):
        table.add_row(name, *(f"{1000 * pct(v, q):.2f}" for v in (a, b, d) for q in (0.5, 0.99)))
    console.print(table)


if __name__ == "__main__":
    main()
