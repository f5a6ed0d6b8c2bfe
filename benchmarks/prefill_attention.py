"""The prefill attention kernel against SDPA: one layer's attention alone, then a whole prefill, same run.

    python -m benchmarks.prefill_attention --model DIR [--dtype auto] [--prompts 4] [--prompt 512] [--rounds 5]
        [--against-level avx512]

First table: one prompt chunk's attention (the model's heads, KV heads and head dimension, random q/K/V in a
paged cache) by the C kernel and by SDPA, a whole prompt (causal) and a chunk after cached context,
milliseconds per call, the fastest of 30. Second table: ``--prompts`` prompts of ``--prompt`` random tokens
prefilled by one engine, rounds alternating between the kernel and SDPA for prompt chunks (the decode
kernel and everything else the same), seconds per round. ``--against-level`` adds the kernel built for
another ISA level this CPU runs (``avx512`` beside ``avx512bf16``'s bfloat16 products) to both tables.
Threads come from the environment (``OMP_NUM_THREADS=1`` for one engine's share of 2 cores).
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import random
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from halfmoon.engine import kernel_build, native
from halfmoon.engine.attention import AttentionBatch, AttentionKernels, paged_attention
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.prefill_kernel import PrefillBatch, PrefillKernel, prefill_kernel
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


def attention_alone(engine: LLMEngine, ways: dict[str, AttentionKernels], past: int, queries: int) -> dict[str, float]:
    """Milliseconds of each way for one chunk of ``queries`` after ``past`` cached tokens, the model's shapes."""
    runner, gen = engine.runner, torch.Generator().manual_seed(past + queries)
    heads, kv_heads, dim, dtype = runner.num_heads, runner.num_kv_heads, runner.head_dim, engine.config.torch_dtype
    context = past + queries
    k_cache, v_cache = (torch.randn(kv_heads, context, dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(queries, heads, dim, generator=gen).to(dtype)
    mask = None if not past else torch.arange(past, context)[:, None] >= torch.arange(context)
    seqs = [SeqAttention(0, queries, ((0, context),), mask)]
    batch = AttentionBatch(torch.zeros(queries, dtype=torch.long), seqs, None, PrefillBatch.of(seqs))
    scale = dim ** -0.5
    return {name: fastest_ms(lambda kernels=kernels: paged_attention(q, k_cache, v_cache, batch, scale, kernels))
            for name, kernels in ways.items()}


def level_kernel(name: str) -> PrefillKernel:
    """The prefill kernel built for ISA level ``name`` (prebuilt, else compiled into the kernel cache)."""
    level = next((level for level in kernel_build.levels_for(platform.machine()) if level.name == name), None)
    if level is None or not set(level.cpu_flags) <= kernel_build.cpu_flags():
        raise SystemExit(f"--against-level {name}: not a level this CPU runs")
    source = kernel_build.KERNELS / "prefill_attention.c"
    return PrefillKernel(ctypes.CDLL(str(native.prebuilt(source, level) or native.built(source, level))))


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
    parser.add_argument("--against-level", help="also the kernel of this ISA level (e.g. avx512), same run")
    args = parser.parse_args()
    kernel = prefill_kernel()
    if kernel is None:
        raise SystemExit("no prefill kernel here (no C compiler, or HALFMOON_PREFILL_KERNEL=0): nothing to compare")
    # random prompts share no prefix: every round computes them whole
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_batched_tokens=2048,
                                    prefill_chunk_size=512))
    ways = {"kernel": engine.runner.kernels._replace(prefill=kernel), "SDPA": engine.runner.kernels._replace(prefill=None)}
    if args.against_level:
        ways[f"{args.against_level} kernel"] = engine.runner.kernels._replace(prefill=level_kernel(args.against_level))
    others = [name for name in ways if name != "kernel"]
    console = Console()
    title = f"({engine.config.resolved_dtype}, {kernel_build.this_cpu().name} level, {torch.get_num_threads()} threads)"

    alone = Table(title=f"One chunk's attention, {engine.runner.num_heads} heads over {engine.runner.num_kv_heads} "
                        f"KV heads, head dim {engine.runner.head_dim} {title}")
    for column in ("cached tokens", "chunk tokens", *(f"{name} ms" for name in ways), *(f"{name} / kernel" for name in others)):
        alone.add_column(column, justify="right")
    for past, queries in ((0, 512), (512, 512), (0, 2048), (2000, 48)):
        ms = attention_alone(engine, ways, past, queries)
        alone.add_row(str(past), str(queries), *(f"{ms[name]:.2f}" for name in ways),
                      *(f"{ms[name] / ms['kernel']:.2f}x" for name in others))
    console.print(alone)

    rng = random.Random(0)
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    engine.runner.kernels = ways["kernel"]
    prefill_round(engine, rng, 1, args.prompt)  # warm-up
    for _ in range(args.rounds):
        for name, kernels in ways.items():
            engine.runner.kernels = kernels
            seconds[name].append(prefill_round(engine, rng, args.prompts, args.prompt))
    whole = Table(title=f"Prefill of {args.prompts} x {args.prompt} random tokens, rounds alternating {title}")
    for column in ("round", *(f"{name} s" for name in ways), *(f"{name} / kernel" for name in others)):
        whole.add_column(column, justify="right")
    for i in range(args.rounds):
        whole.add_row(str(i + 1), *(f"{seconds[name][i]:.3f}" for name in ways),
                      *(f"{seconds[name][i] / seconds['kernel'][i]:.2f}x" for name in others))
    best = {name: min(times) for name, times in seconds.items()}
    whole.add_row("fastest", *(f"{best[name]:.3f}" for name in ways),
                  *(f"{best[name] / best['kernel']:.2f}x" for name in others))
    console.print(whole)

if __name__ == "__main__":
    main()
