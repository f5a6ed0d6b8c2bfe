"""The prompt-chunk attention kernel against SDPA on real paged caches: several chunks in one call, split
spans, cached context before a chunk, grouped-query heads, float32 and bfloat16; beside the decode kernel in
one step; the same rows however a prompt is cut into chunks; and the engine's greedy output with it on and
off. Its fallback is tested with the decode kernel's (test_decode_kernel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from halfmoon.engine import kernel_build
from halfmoon.engine.attention import AttentionBatch, AttentionKernels, paged_attention
from halfmoon.engine.decode_kernel import DecodeBatch, decode_kernel
from halfmoon.engine.prefill_kernel import PrefillBatch, PrefillKernel, prefill_kernel
from halfmoon.engine.seq_attention import SeqAttention
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine, random_prompts


@pytest.fixture(scope="module")
def kernel() -> PrefillKernel:
    built = prefill_kernel()
    if built is None:
        pytest.skip("no C compiler here: the engine uses SDPA (the fallback is tested below)")
    return built


def chunk(row: int, spans: tuple[tuple[int, int], ...], query_len: int) -> SeqAttention:
    """A chunk of ``query_len`` queries ending a context of ``spans``, masked as the model runner masks it."""
    context = sum(end - start for start, end in spans)
    past = context - query_len
    mask = None if not past else torch.arange(past, context)[:, None] >= torch.arange(context)
    return SeqAttention(row, query_len, spans, mask)


def step_of(shapes: list[tuple[tuple[tuple[int, int], ...], int]]) -> AttentionBatch:
    """One sequence per (spans, queries) in step order: a chunk where queries > 1, else a decode query."""
    seqs, row = [], 0
    for spans, queries in shapes:
        seqs.append(chunk(row, spans, queries) if queries > 1 else SeqAttention(row, 1, spans, None))
        row += queries
    return AttentionBatch(torch.zeros(row, dtype=torch.long), seqs, DecodeBatch.of(seqs), PrefillBatch.of(seqs))


def sdpa(batch: AttentionBatch) -> AttentionBatch:
    return batch._replace(decode=None, prefill=None)


def caches(kv_heads: int, dim: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(kv_heads, 4096, dim, generator=gen).to(dtype),
            torch.randn(kv_heads, 4096, dim, generator=gen).to(dtype))


def queries(batch: AttentionBatch, heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``[tokens, heads, dim]`` sliced from a fused projection's output, as the model runner's q is."""
    fused = torch.randn(len(batch.slots), heads + 2 * kv_heads, dim, generator=torch.Generator().manual_seed(3))
    return fused.to(dtype)[:, :heads]


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class TestAgainstSdpa:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 64), (16, 2, 128), (8, 1, 256), (8, 4, 32), (2, 1, 80)])
    def test_every_chunk_row_matches(self, kernel, dtype, heads, kv_heads, dim) -> None:
        batch = step_of([
            (((0, 512),), 512),  # a whole prompt
            (((600, 616), (1000, 1133)), 37),  # a chunk after 112 cached tokens, over two runs of blocks
            (((2000, 2002),), 2),  # the smallest chunk
            (((3000, 3100), (2500, 2530), (3500, 3700)), 200),  # runs out of slot order
        ])
        k_cache, v_cache = caches(kv_heads, dim, dtype, seed=heads * 100 + dim)
        q = queries(batch, heads, kv_heads, dim, dtype)
        fast = paged_attention(q, k_cache, v_cache, batch, 0.125, AttentionKernels(prefill=kernel))
        slow = paged_attention(q, k_cache, v_cache, sdpa(batch), 0.125)
        assert fast.shape == slow.shape == (len(batch.slots), heads * dim)
        torch.testing.assert_close(fast.float(), slow.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_beside_decodes_both_kernels_serve_one_step(self, kernel, dtype) -> None:
        batch = step_of([(((0, 300),), 1), (((400, 700),), 120), (((800, 900), (1200, 1201)), 1),
                         (((2000, 2040),), 40)])
        k_cache, v_cache = caches(3, 64, dtype, seed=5)
        q = queries(batch, 9, 3, 64, dtype)
        both = AttentionKernels(decode=decode_kernel(), prefill=kernel)
        assert both.decode is not None
        slow = paged_attention(q, k_cache, v_cache, sdpa(batch), 0.125)
        for fast in (paged_attention(q, k_cache, v_cache, batch, 0.125, both),
                     paged_attention(q, k_cache, v_cache, batch._replace(decode=None), 0.125,  # decodes on SDPA
                                     AttentionKernels(prefill=kernel))):
            torch.testing.assert_close(fast.float(), slow.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])

    def test_a_query_gets_the_same_bits_however_the_prompt_is_cut(self, kernel) -> None:
        """Key tiles start at fixed positions, so a row does not depend on which chunk computed it (a prompt
        split across steps, or prefilled again elsewhere after a migration)."""
        k_cache, v_cache = caches(3, 64, torch.bfloat16, seed=9)
        whole = step_of([(((0, 300),), 300)])
        q = queries(whole, 9, 3, 64, torch.bfloat16)
        at_once = paged_attention(q, k_cache, v_cache, whole, 0.125, AttentionKernels(prefill=kernel))
        first, second = step_of([(((0, 130),), 130)]), step_of([(((0, 300),), 170)])
        cut = torch.cat([paged_attention(q[:130], k_cache, v_cache, first, 0.125, AttentionKernels(prefill=kernel)),
                         paged_attention(q[130:], k_cache, v_cache, second, 0.125, AttentionKernels(prefill=kernel))])
        assert torch.equal(at_once, cut)

    def test_shapes_it_does_not_take_are_left_to_sdpa(self, kernel) -> None:
        batch = step_of([(((0, 10),), 4)])
        assert batch.prefill is not None
        assert kernel(torch.randn(4, 4, 24), torch.randn(2, 16, 24), torch.randn(2, 16, 24), batch.prefill, 1.0) is None
        assert kernel(torch.randn(4, 34, 64), torch.randn(2, 16, 64), torch.randn(2, 16, 64), batch.prefill, 1.0) is None
        strided = torch.randn(2, 32, 64)[:, ::2]  # a cache the kernel cannot index as [kv_heads, slots, dim]
        assert kernel(torch.randn(4, 4, 64), strided, strided.contiguous(), batch.prefill, 1.0) is None
        half = torch.randn(4, 4, 64).half()
        assert kernel(half, half[:2].clone(), half[:2].clone(), batch.prefill, 1.0) is None
        # and paged_attention then serves the chunk with SDPA
        k_cache, v_cache = torch.randn(2, 16, 24), torch.randn(2, 16, 24)
        q = torch.randn(4, 4, 24)
        torch.testing.assert_close(paged_attention(q, k_cache, v_cache, batch, 1.0, AttentionKernels(prefill=kernel)),
                                   paged_attention(q, k_cache, v_cache, sdpa(batch), 1.0))


class TestEngine:
    def test_greedy_output_is_the_same_with_and_without_the_kernel(self, kernel, tiny_llama: Path) -> None:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = random_prompts(1000, [5, 40, 77, 130, 700], seed=22)
        with_kernel = make_engine(tiny_llama)
        assert with_kernel.runner.kernels.prefill is not None
        without = make_engine(tiny_llama)
        without.runner.kernels = without.runner.kernels._replace(prefill=None)
        assert with_kernel.generate(prompts, params) == without.generate(prompts, params)


    def test_bfloat16_prompt_chunks_go_to_sdpa_where_the_cpu_has_amx(self, kernel, tiny_llama: Path) -> None:
        """SDPA takes AMX tiles through oneDNN, which the kernel's AVX512-BF16 products do not match: there a
        bfloat16 engine leaves prompt chunks to SDPA; float32 keeps the kernel on every CPU."""
        amx = "amx_bf16" in kernel_build.cpu_flags()
        assert make_engine(tiny_llama).runner.kernels.prefill is not None
        bf16 = make_engine(tiny_llama, dtype="bfloat16").runner.kernels
        assert (bf16.prefill is None) == amx
        assert bf16.decode is not None
