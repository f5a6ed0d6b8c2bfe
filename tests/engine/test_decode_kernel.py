"""The batched decode-attention kernel against SDPA, on real paged caches: several sequences, split
spans, grouped-query heads, float32 and bfloat16; the engine's greedy output with it on and
off; and both attention kernels' fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from halfmoon.engine import decode_kernel as kernels
from halfmoon.engine import native
from halfmoon.engine.attention import AttentionBatch, AttentionKernels, paged_attention
from halfmoon.engine.decode_kernel import DecodeBatch, decode_kernel
from halfmoon.engine.prefill_kernel import prefill_kernel
from halfmoon.engine.seq_attention import SeqAttention
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import kernel_sources_alone, make_engine, random_prompts


@pytest.fixture(scope="module")
def kernel() -> kernels.DecodeKernel:
    built = decode_kernel()
    if built is None:
        pytest.skip("no C compiler here: the engine uses SDPA (the fallback is tested below)")
    return built


def batch_of(spans: list[tuple[tuple[int, int], ...]], prefill_at: int | None = None) -> AttentionBatch:
    """One decode query per span list; optionally a 3-token prefill chunk at position ``prefill_at``."""
    seqs, row = [], 0
    for index, s in enumerate(spans):
        if index == prefill_at:
            start, end = s[0]
            seqs.append(SeqAttention(row, 3, ((start, end),), None))
            row += 3
            continue
        seqs.append(SeqAttention(row, 1, s, None))
        row += 1
    return AttentionBatch(torch.zeros(row, dtype=torch.long), seqs, DecodeBatch.of(seqs))


class TestAgainstSdpa:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (16, 2, 128), (8, 2, 80)])
    def test_every_decode_row_matches_and_prefill_rows_are_untouched(self, kernel, dtype, heads, kv_heads, dim) -> None:
        gen = torch.Generator().manual_seed(heads * 100 + dim)
        k_cache = torch.randn(kv_heads, 4096, dim, generator=gen).to(dtype)
        v_cache = torch.randn(kv_heads, 4096, dim, generator=gen).to(dtype)
        spans = [((0, 1),), ((100, 400),), ((500, 532), (800, 1000), (1200, 1201)), ((2000, 2700),), ((3000, 3050),)]
        batch = batch_of(spans, prefill_at=4)
        q = torch.randn(len(batch.slots), heads, dim, generator=gen).to(dtype)
        fast = paged_attention(q, k_cache, v_cache, batch, 0.125, AttentionKernels(decode=kernel))
        slow = paged_attention(q, k_cache, v_cache, batch._replace(decode=None), 0.125)
        tolerance = 1e-5 if dtype is torch.float32 else 2e-2
        assert fast.shape == slow.shape == (len(batch.slots), heads * dim)
        torch.testing.assert_close(fast.float(), slow.float(), atol=tolerance, rtol=tolerance)

    def test_engines_on_several_threads_may_call_it_at_once(self, kernel) -> None:
        from concurrent.futures import ThreadPoolExecutor

        def one(seed: int) -> bool:
            gen = torch.Generator().manual_seed(seed)
            k_cache, v_cache = torch.randn(3, 2048, 64, generator=gen), torch.randn(3, 2048, 64, generator=gen)
            batch = batch_of([((0, 300 + seed),), ((500, 1500 + seed),)])
            q = torch.randn(len(batch.slots), 9, 64, generator=gen)
            expected = paged_attention(q, k_cache, v_cache, batch._replace(decode=None), 0.125)
            return all(torch.allclose(paged_attention(q, k_cache, v_cache, batch, 0.125, AttentionKernels(decode=kernel)), expected, atol=1e-5)
                       for _ in range(20))

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(one, range(8)))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_a_result_depends_on_the_keys_not_on_where_their_blocks_lie(self, kernel, dtype) -> None:
        gen = torch.Generator().manual_seed(5)
        keys, values = torch.randn(3, 150, 64, generator=gen).to(dtype), torch.randn(3, 150, 64, generator=gen).to(dtype)
        placements = [((0, 150),), ((16, 32), (64, 80), (200, 318)), ((300, 301), (400, 400), (500, 649))]
        q = torch.randn(1, 9, 64, generator=gen).to(dtype)
        outputs = []
        for spans in placements:
            k_cache, v_cache = torch.zeros(3, 1024, 64, dtype=dtype), torch.zeros(3, 1024, 64, dtype=dtype)
            taken = 0
            for start, end in spans:
                k_cache[:, start:end] = keys[:, taken:taken + end - start]
                v_cache[:, start:end] = values[:, taken:taken + end - start]
                taken += end - start
            outputs.append(paged_attention(q, k_cache, v_cache, batch_of([spans]), 0.125, AttentionKernels(decode=kernel)))
        assert all(torch.equal(outputs[0], other) for other in outputs[1:])

    def test_shapes_it_does_not_take_are_left_to_sdpa(self, kernel) -> None:
        batch = batch_of([((0, 10),)])
        assert kernel(torch.randn(1, 34, 8), torch.randn(2, 16, 8), torch.randn(2, 16, 8), batch.decode, 1.0) is None
        assert kernel(torch.randn(1, 4, 66), torch.randn(2, 16, 66), torch.randn(2, 16, 66), batch.decode, 1.0) is None
        assert kernel(torch.randn(1, 4, 8).half(), torch.randn(2, 16, 8).half(), torch.randn(2, 16, 8).half(),
                      batch.decode, 1.0) is None


class TestEngine:
    def test_greedy_output_is_the_same_with_and_without_the_kernel(self, kernel, tiny_llama: Path) -> None:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = random_prompts(1000, [5, 40, 77, 130], seed=21)
        with_kernel = make_engine(tiny_llama)
        assert with_kernel.runner.kernels.decode is not None
        without = make_engine(tiny_llama)
        without.runner.kernels = without.runner.kernels._replace(decode=None)
        assert with_kernel.generate(prompts, params) == without.generate(prompts, params)


class TestFallback:
    @pytest.mark.parametrize(("switch", "build"), [("HALFMOON_DECODE_KERNEL", decode_kernel),
                                                   ("HALFMOON_PREFILL_KERNEL", prefill_kernel)])
    def test_switched_off_or_without_a_compiler_it_is_none(self, monkeypatch, tmp_path: Path, switch,
                                                            build) -> None:
        def fresh() -> object:
            native.loaded.cache_clear()
            return build()

        try:
            monkeypatch.setenv(switch, "0")
            assert fresh() is None
            monkeypatch.setenv(switch, "1")
            monkeypatch.setenv("CC", "no-such-compiler")
            monkeypatch.setenv("HALFMOON_KERNEL_DIR", str(tmp_path / "cache"))
            monkeypatch.setattr(native, "KERNELS", kernel_sources_alone(tmp_path / "sources"))
            assert fresh() is None and not (tmp_path / "cache").exists()
        finally:
            monkeypatch.undo()
            fresh()
