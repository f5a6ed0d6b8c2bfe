"""The checks that need a GPU, in one short run (benchmarks/gpu_check.sh wraps it with a time limit).

1. exactness: the paged engine on CUDA against transformers generate on CUDA, greedy, token for token,
   in float32 and bfloat16, on a tiny model and on one of SmolLM2-135M's shape;
2. decode throughput on CUDA at batch 1, 32 and 64 (baseline: transformers generate at the same batch);
3. hand-off bandwidth: GPU -> pinned host -> GPU through ``PinnedStaging`` (baseline: pageable
   ``tensor.cpu()`` / ``.to(device)``), and GPU-to-GPU between processes through CUDA IPC
   (``export_ipc`` in a child, ``import_ipc`` + one device copy here; baseline: the same device
   copy within one process).
Prints one JSON line per result and a summary table. Run: python -m benchmarks.gpu_check [--model DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import msgspec
import torch

HANDOFF_BYTES = 256 << 20


def emit(name: str, **values: object) -> None:
    print(json.dumps({"check": name, **values}), flush=True)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _hf(model: str, dtype: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=DTYPES[dtype]).to("cuda").eval()


def _engine(model: str, dtype: str, kv_bytes: int):  # type: ignore[no-untyped-def]
    from halfmoon.engine.config import EngineConfig
    from halfmoon.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, device="cuda", dtype=dtype, max_num_seqs=64,
                                  max_num_batched_tokens=4096, prefill_chunk_size=2048, kv_cache_bytes=kv_bytes))


def exactness(model: str, dtype: str, tokens: int = 16) -> None:
    """Greedy, token for token, against transformers in the same dtype on the same GPU."""
    from halfmoon.protocol.sampling import SamplingParams

    engine = _engine(model, dtype, 1 << 30)
    hf = _hf(model, dtype)
    gen = torch.Generator().manual_seed(0)
    lengths = (1, 7, 16, 33, 100, 257, 600, 1500)
    batch = [torch.randint(0, engine.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ours = engine.generate(batch, params)
    equal, first_divergence = 0, []
    for prompt, got in zip(batch, ours):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                          do_sample=False)[0, len(prompt):].tolist()
        equal += ref == list(got)
        first_divergence.append(next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None))
    emit("exactness", model=Path(model).name, dtype=dtype, prompts=len(ours), identical=equal,
         first_divergence=first_divergence)


def decode_throughput(model: str, dtype: str, tokens: int = 64) -> None:
    """Decode-only tokens/s at batch 1, 32 and 64, 128-token prompts. Baseline: transformers ``generate``
    at the same batch (equal lengths, so no padding), its prefill taken out by timing 1 token apart."""
    from benchmarks.engine_throughput import _prompts, engine_decode_tps

    engine = _engine(model, dtype, 4 << 30)
    hf = _hf(model, dtype)
    for batch in (1, 32, 64):
        prompts = _prompts(engine.vocab_size, batch, 128, batch)
        engine_decode_tps(engine, prompts, 8)  # warm-up: kernels, allocator
        tps = engine_decode_tps(engine, prompts, tokens)
        base = hf_decode_tps(hf, prompts, tokens)
        emit("decode", model=Path(model).name, dtype=dtype, batch=batch, engine_tok_s=round(tps),
             transformers_tok_s=round(base), ratio=round(tps / base, 2))


def hf_decode_tps(hf, prompts: list[list[int]], tokens: int) -> float:  # type: ignore[no-untyped-def]
    ids = torch.tensor(prompts, device="cuda")

    def run(new: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(tokens)  # warm-up
    return len(prompts) * (tokens - 1) / min(run(tokens) - run(1) for _ in range(2))


def best_gbps(fn, nbytes: int, rounds: int = 10) -> float:
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def pinned_handoff() -> None:
    from halfmoon.transfer.cuda_ipc import PinnedStaging

    src = torch.randint(0, 255, (HANDOFF_BYTES,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    staging = PinnedStaging(HANDOFF_BYTES)
    host = bytes(staging.to_host(src))
    staging.from_host(host, dst)
    assert torch.equal(src, dst), "pinned round trip changed the bytes"
    out = best_gbps(lambda: staging.to_host(src), HANDOFF_BYTES)
    back = best_gbps(lambda: staging.from_host(staging.buffer.numpy(), dst), HANDOFF_BYTES)
    pageable = torch.empty(HANDOFF_BYTES, dtype=torch.uint8)
    base_out = best_gbps(lambda: pageable.copy_(src), HANDOFF_BYTES)
    base_back = best_gbps(lambda: dst.copy_(pageable), HANDOFF_BYTES)
    emit("pinned", gpu_to_host_gbps=round(out, 1), host_to_gpu_gbps=round(back, 1),
         pageable_gpu_to_host_gbps=round(base_out, 1), pageable_host_to_gpu_gbps=round(base_back, 1))


CHILD = """
import sys, msgspec, torch
from halfmoon.transfer.cuda_ipc import export_ipc
t = torch.arange({n}, dtype=torch.int64, device="cuda").view(torch.uint8)
sys.stdout.write(msgspec.json.encode(export_ipc(t)).decode() + "\\n"); sys.stdout.flush()
sys.stdin.read()  # keep the tensor alive until the importer is done
"""


def ipc_handoff() -> None:
    from halfmoon.transfer.cuda_ipc import CudaIpcHandle, import_ipc

    n = HANDOFF_BYTES // 8
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(n=n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        handle = msgspec.json.decode(child.stdout.readline(), type=CudaIpcHandle)  # type: ignore[union-attr]
        shared = import_ipc(handle)
        expect = torch.arange(n, dtype=torch.int64, device="cuda").view(torch.uint8)
        assert torch.equal(shared, expect), "CUDA IPC import does not see the exporter's bytes"
        mine = torch.empty_like(shared)
        ipc = best_gbps(lambda: mine.copy_(shared), HANDOFF_BYTES)
        local = best_gbps(lambda: mine.copy_(expect), HANDOFF_BYTES)
        emit("cuda_ipc", device_copy_from_peer_gbps=round(ipc, 1), same_process_device_copy_gbps=round(local, 1),
             handle_bytes=len(msgspec.json.encode(handle)))
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: a fresh tiny Llama)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        emit("cuda", available=False)
        sys.exit("no CUDA device: nothing checked")
    emit("cuda", available=True, device=torch.cuda.get_device_name(0), torch=torch.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        from halfmoon.cli.model_tools import make_tiny_model

        # A model of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads over 3 KV heads), random weights
        # and a small vocabulary: the size this project serves on CPUs, without a download.
        models = [args.model] if args.model else [
            str(make_tiny_model(Path(tmp) / "tiny")),
            str(make_tiny_model(Path(tmp) / "smollm2-shape", hidden_size=576, layers=30, heads=9, kv_heads=3)),
        ]
        checks = [functools.partial(check, model, dtype) for model in models for dtype in DTYPES
                  for check in (exactness, decode_throughput)]
        failures = 0
        for check in (*checks, pinned_handoff, ipc_handoff):
            try:
                check()
            except Exception as exc:  # one broken check must not hide the others' results
                failures += 1
                frame = traceback.extract_tb(exc.__traceback__)[-1]
                emit("error", check=getattr(check, "func", check).__name__, error=f"{type(exc).__name__}: {exc}",
                     at=f"{frame.filename}:{frame.lineno}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
