"""The prefill attention kernel against SDPA: one layer's attention alone, then a whole prefill, same run.

    python -m benchmarks.prefill_attention --model DIR [--dtype auto] [--prompts 4] [--prompt 512] [--rounds 5]

First table: one prompt chunk's attention (the model's heads, KV heads and head dimension, random q/K/V in a
paged cache) by the C kernel and by SDPA, a whole prompt (causal) and a chunk after cached context,
milliseconds per call, the fastest of 30. Second table: ``--prompts`` prompts of ``--prompt`` random tokens
prefilled by one engine, rounds alternating between the kernel and SDPA for prompt chunks (the decode
kernel and everything else the same), seconds per round. Threads come from the environment
(``OMP_NUM_THREADS=1`` for one engine's share of 2 cores).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from halfmoon.engine.attention import SDPA_ONLY, AttentionBatch, AttentionKernels, paged_attention
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.prefill_kernel import PrefillBatch, prefill_kernel
from halfmoon.engine.seq_attention import SeqAttention
from halfmoon.protocol.sampling import SamplingParams


def fastest_ms(call: Callable[[], object], repeats: int = 30) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def attention_alone(engine: LLMEngine, kernels: AttentionKernels, past: int, queries: int) -> tuple[float, float]:
    """(kernel ms, SDPA ms) for one chunk of ``queries`` after ``past`` cached tokens, the model's shapes."""
    runner, gen = engine.runner, torch.Generator().manual_seed(past + queries)
    heads, kv_heads, dim, dtype = runner.num_heads, runner.num_kv_heads, runner.head_dim, engine.config.torch_dtype
    context = past + queries
    k_cache, v_cache = (torch.randn(kv_heads, context, dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(queries, heads, dim, generator=gen).to(dtype)
    mask = None if not past else torch.arange(past, context)[:, None] >= torch.arange(context)
    seqs = [SeqAttention(0, queries, ((0, context),), mask)]
    batch = AttentionBatch(torch.zeros(queries, dtype=torch.long), seqs, None, PrefillBatch.of(seqs))
    scale = dim ** -0.5
    return (fastest_ms(lambda: paged_attention(q, k_cache, v_cache, batch, scale, kernels)),
            fastest_ms(lambda: paged_attention(q, k_cache, v_cache, batch, scale, SDPA_ONLY)))


def prefill_round(engine: LLMEngine, rng: random.Random, prompts: int, length: int) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(prompts):
        engine.add_request(f"p{time.monotonic_ns()}-{i}", [rng.randrange(engine.vocab_size) for _ in range(length)],
                           params)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per prefill round")
    parser.add_argument("--prompt", type=int, default=512, help="tokens per prompt")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    kernel = prefill_kernel()
    if kernel is None:
        raise SystemExit("no prefill kernel here (no C compiler, or HALFMOON_PREFILL_KERNEL=0): nothing to compare")
    # random prompts share no prefix: every round computes them whole
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_batched_tokens=2048,
                                    prefill_chunk_size=512))
    with_kernel = engine.runner.kernels._replace(prefill=kernel)
    without = engine.runner.kernels._replace(prefill=None)
    console = Console()
    title = f"({engine.config.resolved_dtype}, {torch.get_num_threads()} threads)"

    alone = Table(title=f"One chunk's attention, {engine.runner.num_heads} heads over {engine.runner.num_kv_heads} "
                        f"KV heads, head dim {engine.runner.head_dim} {title}")
    for column in ("cached tokens", "chunk tokens", "kernel ms", "SDPA ms", "SDPA / kernel"):
        alone.add_column(column, justify="right")
    for past, queries in ((0, 512), (512, 512), (0, 2048), (2000, 48)):
        fast, slow = attention_alone(engine, with_kernel, past, queries)
        alone.add_row(str(past), str(queries), f"{fast:.2f}", f"{slow:.2f}", f"{slow / fast:.2f}x")
    console.print(alone)

    rng = random.Random(0)
    seconds: dict[str, list[float]] = {"kernel": [], "SDPA": []}
    engine.runner.kernels = with_kernel
    prefill_round(engine, rng, 1, args.prompt)  # warm-up
    for _ in range(args.rounds):
        for name, kernels in (("kernel", with_kernel), ("SDPA", without)):
            engine.runner.kernels = kernels
            seconds[name].append(prefill_round(engine, rng, args.prompts, args.prompt))
    whole = Table(title=f"Prefill of {args.prompts} x {args.prompt} random tokens, rounds alternating {title}")
    for column in ("round", "kernel s", "SDPA s", "SDPA / kernel"):
        whole.add_column(column, justify="right")
    for i in range(args.rounds):
        whole.add_row(str(i + 1), f"{seconds['kernel'][i]:.3f}", f"{seconds['SDPA'][i]:.3f}",
                      f"{seconds['SDPA'][i] / seconds['kernel'][i]:.2f}x")
    best = min(seconds["SDPA"]) / min(seconds["kernel"])
    whole.add_row("fastest", f"{min(seconds['kernel']):.3f}", f"{min(seconds['SDPA']):.3f}", f"{best:.2f}x")
    console.print(whole)


if __name__ == "__main__":
    main()
