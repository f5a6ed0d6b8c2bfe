"""Decode attention for a whole batch in one call, by a small C kernel built on first use.

Why: on a CPU each per-sequence SDPA call costs ~100 us of dispatch and thread wake-ups for a
few microseconds of work. At batch 8 those calls are a third of a decode step. The kernel
(``kernels/decode_attention.c``) serves every decode sequence of a step in one call, with the
sequences and KV heads spread over torch's own OpenMP threads.

It is built on first use (engine/native.py) and used for CPU tensors in float32 or bfloat16. Without
a compiler, when the build fails, or with ``HALFMOON_DECODE_KERNEL=0``, attention stays on SDPA.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from halfmoon.engine import native
from halfmoon.engine.native import pointer

if TYPE_CHECKING:
    from halfmoon.engine.seq_attention import SeqAttention

DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class DecodeBatch(NamedTuple):
    """A step's decode sequences (one query each), as the kernel reads them."""

    rows: torch.Tensor  # [n] each one's query row in the step
    spans: torch.Tensor  # [m, 2] int64 (start, end) cache slots, every sequence's in turn
    offsets: torch.Tensor  # [n + 1] int64: sequence i reads spans[offsets[i]:offsets[i + 1]]

    @classmethod
    def of(cls, seqs: Sequence[SeqAttention]) -> DecodeBatch | None:
        decoding = [s for s in seqs if s.query_len == 1]
        if not decoding:
            return None
        offsets = [0]
        for s in decoding:
            offsets.append(offsets[-1] + len(s.spans))
        spans = [span for s in decoding for span in s.spans]
        return cls(torch.tensor([s.query_start for s in decoding], dtype=torch.long),
                   torch.tensor(spans, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64))


class DecodeKernel:
    """Contract: ``__call__`` returns ``[n, heads * dim]``, row i the attention of the batch's i-th
    decode query over its spans, equal to SDPA's up to float32 rounding; ``None`` for inputs it
    does not take (another device or dtype, a head group over 16, a head_dim over 256 or not a multiple of
    the CPU's vector width: 16 floats with AVX-512, 8 with AVX2, 4 with SSE2)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._run = library.decode_attention
        self._run.restype = ctypes.c_int

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch,
                 scale: float) -> torch.Tensor | None:
        if q.device.type != "cpu" or q.dtype not in DTYPES or k_cache.dtype != q.dtype:
            return None
        queries = q.index_select(0, batch.rows).contiguous()  # [n, heads, dim]
        n, heads, dim = queries.shape
        kv_heads, slots, _ = k_cache.shape
        out = torch.empty_like(queries)
        failed = self._run(DTYPES[q.dtype], pointer(queries), pointer(k_cache),
                           pointer(v_cache), pointer(out), n, heads, kv_heads, dim,
                           ctypes.c_long(slots), pointer(batch.spans), pointer(batch.offsets),
                           ctypes.c_float(scale), torch.get_num_threads())
        return None if failed else out.view(n, heads * dim)


def decode_kernel() -> DecodeKernel | None:
    """The kernel, built or taken from the cache (native.library keeps it loaded); None where it cannot be
    (the reason is logged once)."""
    library = native.library("decode_attention")
    return DecodeKernel(library) if library is not None else None
