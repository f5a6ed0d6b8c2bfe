"""Decode attention alone, as a decode step meets it: every layer's KV cache distinct, so each call reads
its sequences' keys and values from memory rather than from a cache the last call warmed.

    python -m benchmarks.decode_attention [--batch 8] [--context 576] [--layers 30] [--rounds 3]

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64), bfloat16 and float32. Each round times one
call per layer for every layer, with the C kernel (``engine/kernels/decode_attention.c``) and with the
SDPA path the engine falls back to, same caches, same run; threads come from the environment
(``OMP_NUM_THREADS``). The table gives microseconds per layer call.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from halfmoon.engine.attention import AttentionBatch, AttentionKernels, paged_attention
from halfmoon.engine.decode_kernel import DecodeBatch, decode_kernel
from halfmoon.engine.seq_attention import SeqAttention

HEADS, KV_HEADS, DIM = 9, 3, 64


def step_batch(batch: int, context: int) -> AttentionBatch:
    """``batch`` decode queries, each over its own ``context`` slots, spaced as a block pool places them."""
    seqs = [SeqAttention(i, 1, ((i * (context + 64), i * (context + 64) + context),), None) for i in range(batch)]
    return AttentionBatch(torch.zeros(batch, dtype=torch.long), seqs, DecodeBatch.of(seqs))


def per_call_us(q: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]], batch: AttentionBatch,
                kernels: AttentionKernels) -> float:
    start = time.perf_counter()
    for k_cache, v_cache in caches:
        paged_attention(q, k_cache, v_cache, batch, 0.125, kernels)
    return (time.perf_counter() - start) / len(caches) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=576, help="cached tokens per sequence")
    parser.add_argument("--layers", type=int, default=30, help="distinct caches called in turn")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    kernel = decode_kernel()
    if kernel is None:
        raise SystemExit("the decode kernel is not available here (no C compiler?); nothing to compare")
    batch = step_batch(args.batch, args.context)
    slots = args.batch * (args.context + 64)
    table = Table(title=f"Decode attention, batch {args.batch} x {args.context} cached tokens, {args.layers} layers' "
                        f"caches in turn, {torch.get_num_threads()} threads: us per layer call")
    for column in ("dtype", "round", "C kernel", "SDPA", "SDPA / kernel"):
        table.add_column(column, justify="right")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        caches = [(torch.randn(KV_HEADS, slots, DIM, generator=gen).to(dtype),
                   torch.randn(KV_HEADS, slots, DIM, generator=gen).to(dtype)) for _ in range(args.layers)]
        q = torch.randn(args.batch, HEADS, DIM, generator=gen).to(dtype)
        with_kernel, sdpa = AttentionKernels(decode=kernel), AttentionKernels()
        per_call_us(q, caches, batch, with_kernel)
        per_call_us(q, caches, batch, sdpa)
        for round_ in range(args.rounds):
            fast, slow = per_call_us(q, caches, batch, with_kernel), per_call_us(q, caches, batch, sdpa)
            table.add_row(str(dtype).removeprefix("torch."), str(round_ + 1), f"{fast:,.0f}", f"{slow:,.0f}",
                          f"{slow / fast:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
