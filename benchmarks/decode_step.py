"""Time of one decode step of the engine alone, at a batch of long contexts.

    python -m benchmarks.decode_step --model DIR [--batch 8] [--prompt 512] [--tokens 64] [--rounds 3]

``--batch`` requests of ``--prompt`` random tokens are prefilled, then only decode steps are timed,
``--tokens`` of them per round. Threads and OpenMP come from the environment, so the same command
compares thread layouts and wait policies (``OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE ...``); with
``--profile`` the last round runs under the torch profiler and its operator table is printed.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
from rich.console import Console
from rich.table import Table

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.protocol.sampling import SamplingParams


def decode_round(engine: LLMEngine, rng: random.Random, batch: int, prompt: int, tokens: int) -> float:
    """Seconds per decode step over one round (prefill excluded)."""
    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"s{time.monotonic_ns()}-{i}", [rng.randrange(engine.vocab_size) for _ in range(prompt)],
                           params)
    while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="profile the last round")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=max(64, args.batch),
                                    max_num_batched_tokens=4096, prefill_chunk_size=4096, kv_cache_bytes=2 << 30))
    rng = random.Random(0)
    decode_round(engine, rng, args.batch, args.prompt, 8)  # warm-up
    seconds = [decode_round(engine, rng, args.batch, args.prompt, args.tokens) for _ in range(args.rounds)]
    if args.profile:
        with torch.profiler.profile() as prof:
            decode_round(engine, rng, args.batch, args.prompt, args.tokens)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    table = Table(title=f"Decode step, batch {args.batch} after {args.prompt}-token prompts "
                        f"({engine.config.resolved_dtype}, {torch.get_num_threads()} threads, "
                        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')})")
    for column in ("round", "ms / step", "tokens/s"):
        table.add_column(column, justify="right")
    for i, s in enumerate(seconds, 1):
        table.add_row(str(i), f"{s * 1000:.1f}", f"{args.batch / s:,.0f}")
    Console().print(table)


if __name__ == "__main__":
    main()
