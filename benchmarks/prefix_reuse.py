"""TTFT cold against warm on the live system: long prompts sharing most of their prefix.

    python -m benchmarks.prefix_reuse [--model DIR] [--tokens 4096] [--shared 0.9] [--pairs 5]

Each pair sends a cold request (a prefix never seen, so everything is computed) and then a warm
request with the same prefix and another suffix (the prefix comes from the KVCache pool). Cold
and warm alternate, so machine noise hits both alike. TTFT is the time to the first streamed
token at the client.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import track
from rich.table import Table

from halfmoon.deploy.local import LocalCluster


def ttft(client: httpx.Client, model: str, prompt: list[int]) -> tuple[float, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, cached = None, -1
    with client.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and first is None:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first is not None
    return first, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--shared", type=float, default=0.9)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--pool-only", action="store_true",
                        help="turn off the prefill engine's local prefix cache: warm prefixes come from the pool")
    args = parser.parse_args()
    shared_len = int(args.tokens * args.shared)
    rng = random.Random(0)
    draw = lambda n: [rng.randrange(3, 2000) for _ in range(n)]  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from halfmoon.cli.model_tools import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny-llama"))
        env = {"HALFMOON_PREFILL_CHUNK_SIZE": "2048", "HALFMOON_MAX_NUM_BATCHED_TOKENS": "2048",
               "HALFMOON_LOCAL_PREFIX_CACHE": "false" if args.pool_only else "true"}
        cluster = LocalCluster(model, Path(tmp) / "run", gateway_port=0, namespace="bench", env=env)
        cluster.start()
        try:
            with httpx.Client(base_url=cluster.url, timeout=300) as client:
                name = client.get("/v1/models").json()["data"][0]["id"]
                ttft(client, name, draw(args.tokens))  # warm-up
                cold, warm, hits = [], [], []
                for _ in track(range(args.pairs), description="cold, then warm"):
                    prefix = draw(shared_len)
                    t_cold, c_cold = ttft(client, name, prefix + draw(args.tokens - shared_len))
                    t_warm, c_warm = ttft(client, name, prefix + draw(args.tokens - shared_len))
                    assert c_cold == 0
                    cold.append(t_cold)
                    warm.append(t_warm)
                    hits.append(c_warm)
        finally:
            cluster.stop()
    source = "the pool only" if args.pool_only else "local prefix cache, then the pool"
    table = Table(title=f"TTFT, {args.tokens}-token prompts, {args.shared:.0%} shared prefix from {source} "
                        f"({args.pairs} pairs)")
    for column in ("", "cold median (ms)", "warm median (ms)", "warm / cold", "cached tokens (warm)"):
        table.add_column(column, justify="right")
    ratio = statistics.median(w / c for w, c in zip(warm, cold))
    table.add_row(Path(model).name, f"{1000 * statistics.median(cold):.0f}", f"{1000 * statistics.median(warm):.0f}",
                  f"{ratio:.2f}x", f"{statistics.median(hits):.0f}")
    Console().print(table)


if __name__ == "__main__":
    main()
