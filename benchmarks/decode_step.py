"""Time of one decode step of the engine alone, at a batch of long contexts.

    python -m benchmarks.decode_step --model DIR [--batch 8] [--prompt 512] [--tokens 64] [--rounds 3]
        [--temperature 0] [--unpacked-baseline] [--onednn-baseline] [--pytorch-sampling-baseline]
        [--layers-apart-baseline] [--linear-kernel-baseline]

``--batch`` requests of ``--prompt`` random tokens are prefilled (timed apart, in steps of up to 4,096
tokens), then the decode steps are timed, ``--tokens`` of them per round. Threads and OpenMP come from the environment, so the same command
compares thread layouts and wait policies (``OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE ...``); with
``--profile`` the last round runs under the torch profiler and its operator table is printed.
``--unpacked-baseline`` builds a second engine whose projections are not packed for oneDNN (PyTorch's
own matmul, as float32 ran before 2 December) and alternates rounds between the two, same run;
``--onednn-baseline`` the same with oneDNN's packed projections where the engine takes the linear kernel;
``--pytorch-sampling-baseline`` does the same with a second engine that samples with PyTorch's operators
instead of the sampling kernel (give ``--temperature 1`` to time random sampling);
``--layers-apart-baseline`` with a second engine that runs a step's layers one kernel call at a time
instead of ``kernels/decode_layers.c``'s one call;
``--linear-kernel-baseline`` with a second engine whose bfloat16 projections are on ``kernels/linear.c`` whatever
the CPU (its portable path without AVX512-BF16). The engine keeps oneDNN's AMX tiles where the CPU has them, so
on an AMX CPU this times what the linear kernel, and with it the one-region decode step, would give decode and
prompt steps there; elsewhere the two engines are the same.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from unittest import mock

import torch
from rich.console import Console
from rich.table import Table

from halfmoon.engine import native, weights
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.sampler import Sampler, choose
from halfmoon.protocol.sampling import SamplingParams


def decode_round(engine: LLMEngine, rng: random.Random, batch: int, prompt: int, tokens: int,
                 temperature: float = 0.0) -> tuple[float, float]:
    """Seconds of the round's prefill, and seconds per decode step after it."""
    params = SamplingParams(max_tokens=tokens + 1, temperature=temperature, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"s{time.monotonic_ns()}-{i}", [rng.randrange(engine.vocab_size) for _ in range(prompt)],
                           params)
    start = time.perf_counter()
    while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()
    prefill = time.perf_counter() - start
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return prefill, (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="profile the last round")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else random sampling")
    parser.add_argument("--unpacked-baseline", action="store_true",
                        help="alternate rounds with an engine whose projections are not packed")
    parser.add_argument("--onednn-baseline", action="store_true",
                        help="alternate rounds with an engine on oneDNN's projections instead of the linear kernel")
    parser.add_argument("--pytorch-sampling-baseline", action="store_true",
                        help="alternate rounds with an engine that samples with PyTorch's operators")
    parser.add_argument("--layers-apart-baseline", action="store_true",
                        help="alternate rounds with an engine that runs the layers one kernel call at a time")
    parser.add_argument("--linear-kernel-baseline", action="store_true",
                        help="alternate rounds with an engine whose bfloat16 projections are on the linear kernel "
                             "whatever the CPU")
    args = parser.parse_args()
    engines = {"packed": make_engine(args)}
    if args.unpacked_baseline:
        with (mock.patch("halfmoon.engine.weights._can_pack", lambda _weight: False),
              mock.patch("halfmoon.engine.weights._kernel_for", lambda _weight: None)):
            engines["unpacked"] = make_engine(args)
    if args.onednn_baseline:
        with mock.patch("halfmoon.engine.weights._kernel_for", lambda _weight: None):
            engines["oneDNN"] = make_engine(args)
    if args.pytorch_sampling_baseline:
        engines["pytorch sampling"] = make_engine(args)
        engines["pytorch sampling"].sampler = Sampler(choose)
    if args.layers_apart_baseline:
        engines["layers apart"] = make_engine(args)
        engines["layers apart"].runner.decode_layers = None
    if args.linear_kernel_baseline:
        if native.library("linear") is None:
            parser.error(f"the linear kernel is not built here: {native.loaded('linear').reason}")
        with mock.patch("halfmoon.engine.weights._kernel_for", weights.linear_kernel):
            engines["linear kernel"] = make_engine(args)
    rng = random.Random(0)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    prefills: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():
        decode_round(engine, rng, args.batch, args.prompt, 8, args.temperature)  # warm-up
    for _ in range(args.rounds):
        for name, engine in engines.items():
            prefill, step = decode_round(engine, rng, args.batch, args.prompt, args.tokens, args.temperature)
            prefills[name].append(prefill)
            seconds[name].append(step)
    if args.profile:
        with torch.profiler.profile() as prof:
            decode_round(engines["packed"], rng, args.batch, args.prompt, args.tokens, args.temperature)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    table = Table(title=f"Decode step, batch {args.batch} after {args.prompt}-token prompts "
                        f"({engines['packed'].config.resolved_dtype}, {torch.get_num_threads()} threads, "
                        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}, "
                        f"temperature {args.temperature})")
    baselines = [name for name in engines if name != "packed"]
    for column in ("round", *(f"{name}: ms / step" for name in engines), "packed: tokens/s",
                   *(f"{name} / packed" for name in baselines), *(f"{name}: prefill s" for name in engines),
                   *(f"{name} / packed, prefill" for name in baselines)):
        table.add_column(column, justify="right")
    for i in range(args.rounds):
        row = [str(i + 1), *(f"{seconds[name][i] * 1000:.1f}" for name in engines),
               f"{args.batch / seconds['packed'][i]:,.0f}",
               *(f"{seconds[name][i] / seconds['packed'][i]:.2f}x" for name in baselines),
               *(f"{prefills[name][i]:.2f}" for name in engines),
               *(f"{prefills[name][i] / prefills['packed'][i]:.2f}x" for name in baselines)]
        table.add_row(*row)
    Console().print(table)


def make_engine(args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=max(64, args.batch),
                                  max_num_batched_tokens=4096, prefill_chunk_size=4096, kv_cache_bytes=2 << 30))


if __name__ == "__main__":
    main()
