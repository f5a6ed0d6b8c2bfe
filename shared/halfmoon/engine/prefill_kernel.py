"""Causal attention for every prompt chunk of a step in one call, by a small C kernel built on first use.

Why: PyTorch's CPU attention (SDPA's flash kernel) reached about a quarter of the matrix products' speed
on SmolLM2's heads (9 over 3 KV heads, 64 dimensions), and a chunk after cached context took its masked
path; attention was about a third of a 2,048-token prefill step. The kernel (``kernels/prefill_attention.c``)
reads K and V through each sequence's slots in the paged cache, a tile of keys at a time, for all query
heads of a KV head at once, and parallelizes over (sequence, KV head, tile of queries) on torch's OpenMP
threads. Its result for a query does not depend on how the prompt was cut into chunks: key tiles start at
fixed positions.

It is used for CPU tensors in float32 or bfloat16 with a head dimension that is a multiple of 16, except
bfloat16 on a CPU with AMX (``sdpa_is_faster``). Without a compiler, when the build fails, or with
``HALFMOON_PREFILL_KERNEL=0``, prompt chunks stay on SDPA.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from halfmoon.engine import kernel_build, native
from halfmoon.engine.decode_kernel import DTYPES
from halfmoon.engine.native import pointer

if TYPE_CHECKING:
    from halfmoon.engine.seq_attention import SeqAttention


class PrefillBatch(NamedTuple):
    """A step's prompt chunks (more than one query each), as the kernel reads them."""

    query_start: torch.Tensor  # [n] int64: each one's first query row in the step
    query_len: torch.Tensor  # [n] int64
    slot_map: torch.Tensor  # int64: every sequence's context slots in position order, in turn
    offsets: torch.Tensor  # [n + 1] int64: sequence i's context is slot_map[offsets[i]:offsets[i + 1]]

    @classmethod
    def of(cls, seqs: Sequence[SeqAttention]) -> PrefillBatch | None:
        chunks = [s for s in seqs if s.query_len > 1]
        if not chunks:
            return None
        offsets = [0]
        for s in chunks:
            offsets.append(offsets[-1] + sum(end - start for start, end in s.spans))
        slot_map = torch.cat([torch.arange(start, end, dtype=torch.int64) for s in chunks for start, end in s.spans])
        return cls(torch.tensor([s.query_start for s in chunks], dtype=torch.int64),
                   torch.tensor([s.query_len for s in chunks], dtype=torch.int64), slot_map,
                   torch.tensor(offsets, dtype=torch.int64))


class PrefillKernel:
    """Contract: ``__call__`` returns ``[tokens, heads * dim]`` for a step of ``tokens`` query rows whose rows
    of the batch's chunks hold each query's causal attention over its context (the chunk's last
    ``query_len`` context tokens are its own), equal to SDPA's up to float32 rounding (bfloat16 inputs on the
    ``avx512bf16`` level: up to the probabilities' rounding to bfloat16 as well); other rows are
    undefined. ``None`` for inputs it does not take (another device or dtype, a cache that is not contiguous,
    a head group over 16, a head dimension that is not a multiple of 16 or over 256)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._run = library.prefill_attention
        self._run.restype = ctypes.c_int
        self._scratch = library.prefill_attention_scratch
        self._scratch.restype = ctypes.c_long

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PrefillBatch,
                 scale: float) -> torch.Tensor | None:
        if q.device.type != "cpu" or q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype \
                or q.stride(2) != 1 or q.stride(1) != q.shape[2] \
                or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return None
        tokens, heads, dim = q.shape
        kv_heads, slots, _ = k_cache.shape
        threads = torch.get_num_threads()
        # NOTE: per call: engines in one process (a test cluster) call one kernel from several threads
        scratch = torch.empty(threads * self._scratch(heads // max(kv_heads, 1), dim), dtype=torch.float32)
        out = torch.empty(tokens, heads, dim, dtype=q.dtype)
        failed = self._run(DTYPES[q.dtype], pointer(q), ctypes.c_long(q.stride(0)),
                           pointer(k_cache), pointer(v_cache), pointer(out),
                           len(batch.query_start), pointer(batch.query_start),
                           pointer(batch.query_len), pointer(batch.slot_map),
                           pointer(batch.offsets), heads, kv_heads, dim, ctypes.c_long(slots),
                           ctypes.c_float(scale), pointer(scratch), threads)
        return None if failed else out.view(tokens, heads * dim)


def sdpa_is_faster(dtype: torch.dtype) -> bool:
    """Where SDPA beats the kernel: bfloat16 on a CPU with AMX, whose tiles PyTorch's flash attention
    takes through oneDNN. On a 2-core AMX Xeon, one thread (benchmarks.prefill_attention): a 512-token
    chunk 1.6 ms against the kernel's 4.6 (its AVX512-BF16 products), a 4 x 512 prefill 0.95 s against
    1.30 s. In float32 the two were level (1.03x the prefill), and without AMX the kernel wins."""
    return dtype == torch.bfloat16 and "amx_bf16" in kernel_build.cpu_flags()


def prefill_kernel() -> PrefillKernel | None:
    """The kernel, built or taken from the cache (native.library keeps it loaded); None where it cannot be
    (the reason is logged once)."""
    library = native.library("prefill_attention")
    return PrefillKernel(library) if library is not None else None
