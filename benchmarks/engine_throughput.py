"""Engine decode and prefill throughput against transformers on the same model, same run.

    python -m benchmarks.engine_throughput [--model DIR] [--tokens 64] [--dtype auto]

Without --model a tiny Llama is created in a temporary directory. Three tables: decode-only
tokens/s against transformers ``generate`` at batch 1; prefill of one prompt against one
transformers forward; and prefill of a prompt's last ``--tail`` tokens after a cached prefix
(the rest of the prompt in the engine's prefix cache, in transformers' KV cache) against one
transformers forward of the tail over that cache. Paste them into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, DynamicCache

from halfmoon.core.keys import BlockHasher
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.protocol.sampling import SamplingParams


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def hf_decode_tps(hf, prompt: list[int], tokens: int) -> float:
    ids = torch.tensor([prompt])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    hf.generate(ids, **kwargs)
    start = time.perf_counter()
    hf.generate(ids, **kwargs)
    return tokens / (time.perf_counter() - start)


def engine_decode_tps(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> float:
    """Decode-only tokens/s: prompts are prefilled first, then the timed steps only decode."""
    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", prompt, params)
    while any(s.num_uncomputed > 1 or not s.output_token_ids for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    produced = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start)


def hf_prefill_tps(hf, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf(ids[:, :64])
        start = time.perf_counter()
        hf(ids)
    return len(prompt) / (time.perf_counter() - start)


def engine_prefill_tps(engine: LLMEngine, prompt: list[int]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([prompt[:64]], params)
    start = time.perf_counter()
    engine.generate([prompt], params)
    return len(prompt) / (time.perf_counter() - start)


def hf_tail_tps(hf, prompt: list[int], tail: int) -> float:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        hf(ids[:, :-tail], past_key_values=cache)
        start = time.perf_counter()
        hf(ids[:, -tail:], past_key_values=cache)
    return tail / (time.perf_counter() - start)


def engine_tail_tps(engine: LLMEngine, prompt: list[int], tail: int) -> float:
    """Prefill tokens/s of the last ``tail`` tokens while the rest sits in the local prefix cache."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    keys = BlockHasher(engine.config.block_size, engine.fingerprint.hex()).keys(prompt)
    prefix = prompt[:-tail]
    engine.add_request(f"p{time.monotonic_ns()}", prefix, params, block_keys=keys[: len(prefix) // engine.config.block_size])
    while engine.has_unfinished():
        engine.step()
    engine.add_request(f"t{time.monotonic_ns()}", prompt, params, block_keys=keys)
    start = time.perf_counter()
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    elapsed = time.perf_counter() - start
    return (len(prompt) - outs[-1].num_cached_tokens) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="model directory (default: a fresh tiny Llama)")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prefill", default="512,2048,8192")
    parser.add_argument("--cached", default="2048,8192", help="prompt lengths for the cached-prefix table")
    parser.add_argument("--tail", type=int, default=512, help="uncached tokens at the end of those prompts")
    parser.add_argument("--dtype", default="auto", help="engine dtype (transformers runs the same)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from halfmoon.cli.model_tools import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny"))
        engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=2048,
                                        prefill_chunk_size=2048, kv_cache_bytes=2 << 30))
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=engine.config.torch_dtype).eval()
        console = Console()
        decode = Table(title=f"Decode throughput ({Path(model).name}, {engine.config.resolved_dtype}, "
                             f"{args.tokens} tokens/request, {engine.config.torch_device.type})")
        for column in ("batch", "engine tok/s", "HF generate b=1 tok/s", "ratio"):
            decode.add_column(column, justify="right")
        base = hf_decode_tps(hf, _prompts(engine.vocab_size, 1, 32, 0)[0], args.tokens)
        for batch in (int(b) for b in args.batches.split(",")):
            tps = engine_decode_tps(engine, _prompts(engine.vocab_size, batch, 32, batch), args.tokens)
            decode.add_row(str(batch), f"{tps:,.0f}", f"{base:,.0f}", f"{tps / base:.2f}x")
        console.print(decode)
        prefill = Table(title="Prefill throughput (one prompt, one forward vs chunked engine prefill)")
        for column in ("prompt tokens", "engine tok/s", "HF forward tok/s", "ratio"):
            prefill.add_column(column, justify="right")
        for length in (int(n) for n in args.prefill.split(",")):
            prompt = _prompts(engine.vocab_size, 1, length, length)[0]
            ours, theirs = engine_prefill_tps(engine, prompt), hf_prefill_tps(hf, prompt)
            prefill.add_row(str(length), f"{ours:,.0f}", f"{theirs:,.0f}", f"{ours / theirs:.2f}x")
        console.print(prefill)
        cached = Table(title=f"Prefill of the last {args.tail} tokens after a cached prefix")
        for column in ("prompt tokens", "engine tok/s", "HF forward over its cache tok/s", "ratio"):
            cached.add_column(column, justify="right")
        for length in (int(n) for n in args.cached.split(",") if n):
            prompt = _prompts(engine.vocab_size, 1, length, length + 1)[0]
            ours, theirs = engine_tail_tps(engine, prompt, args.tail), hf_tail_tps(hf, prompt, args.tail)
            cached.add_row(str(length), f"{ours:,.0f}", f"{theirs:,.0f}", f"{ours / theirs:.2f}x")
        console.print(cached)


if __name__ == "__main__":
    main()
