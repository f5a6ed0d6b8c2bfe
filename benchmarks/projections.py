"""The projections of a decoder's layers alone: the linear kernel against oneDNN's packed inner product, same run.

    OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE python -m benchmarks.projections [--rows 1,8,16,64,512,2048]
        [--hidden 576] [--intermediate 1536] [--q-heads 9] [--kv-heads 3] [--layers 30]

For each row count, every layer's QKV, O, gate-up and down projection (random bfloat16 weights of SmolLM2's
shapes by default, 212 MB, more than any cache) is called once in layer order, as a step does; the best of
three repetitions is reported. Threads and OpenMP's wait policy come from the environment: with a passive
wait, each call's parallel region wakes the other threads. Where the engine would not take the kernel (no
AVX512-BF16, or AMX), it says so and times oneDNN alone.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from unittest import mock

import torch
from rich.console import Console
from rich.table import Table

from halfmoon.engine.weights import Projection


def best_seconds(run: Callable[[], object], repetitions: int) -> float:
    run()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repetitions):
            run()
        best = min(best, (time.perf_counter() - start) / repetitions)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,8,16,64,512,2048")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    head_dim = args.hidden // args.q_heads
    shapes = [((args.q_heads + 2 * args.kv_heads) * head_dim, args.hidden), (args.hidden, args.q_heads * head_dim),
              (2 * args.intermediate, args.hidden), (args.hidden, args.intermediate)] * args.layers
    weights = [torch.randn(n, k).bfloat16() for n, k in shapes]
    sides: dict[str, list[Projection]] = {}
    kernel = [Projection(w, None) for w in weights]
    if kernel[0].kernel is not None:
        sides["kernel"] = kernel
    else:
        Console().print("[yellow]the engine takes oneDNN on this CPU (no AVX512-BF16, or AMX): oneDNN alone[/]")
    with mock.patch("halfmoon.engine.weights._kernel_for", lambda _weight: None):
        sides["oneDNN"] = [Projection(w, None) for w in weights]
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6
    table = Table(title=f"{len(weights)} projections, {megabytes:.0f} MB of bfloat16 weights, "
                        f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}")
    for column in ("rows", *(f"{name}: ms" for name in sides), *(f"{name}: GB/s" for name in sides),
                   *(["oneDNN / kernel"] if "kernel" in sides else [])):
        table.add_column(column, justify="right")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in shapes}}
        seconds = {name: best_seconds(lambda side=side, x=inputs: [p(x[w.shape[1]]) for p, w in zip(side, weights)],
                                      max(2, 160 // max(rows, 8)))
                   for name, side in sides.items()}
        table.add_row(str(rows), *(f"{s * 1e3:.2f}" for s in seconds.values()),
                      *(f"{megabytes / 1e3 / s:.1f}" for s in seconds.values()),
                      *([f"{seconds['oneDNN'] / seconds['kernel']:.2f}x"] if "kernel" in seconds else []))
    Console().print(table)


if __name__ == "__main__":
    main()
