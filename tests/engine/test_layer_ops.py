"""The C kernel's one-pass layer math against transformers' modules, on bfloat16 rows of several
sizes; the fallbacks to the modules; and an engine's logits with the kernel on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from halfmoon.engine import layer_ops as ops_module
from halfmoon.engine import native
from halfmoon.engine.layer_ops import LayerOps, NativeLayerOps, layer_ops
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import kernel_sources_alone, make_engine, random_prompts, tokens_and_logprobs

BF16_ULP = 2.0 ** -7  # relative spacing of bfloat16 values
ROWS = [1, 7, 300]


@pytest.fixture(scope="module")
def native_ops() -> NativeLayerOps:
    ops = layer_ops(torch.device("cpu"))
    if not isinstance(ops, NativeLayerOps):
        pytest.skip("no C compiler here: the engine uses the modules (the fallback is tested below)")
    return ops


def rows_of(rows: int, width: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def rms_norm(dim: int) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(dim, eps=1e-5)
    norm.weight.data = rows_of(1, dim, seed=dim, scale=1.0)[0]
    return norm.to(torch.bfloat16)


def assert_within_an_ulp_rarely(fast: torch.Tensor, slow: torch.Tensor) -> None:
    """The norm's mean of squares is summed in another order than PyTorch's: a row's scale may differ
    in its last float32 bit, which moves an element by one bfloat16 step, rarely."""
    differ = fast != slow
    assert differ.float().mean() < 0.01
    torch.testing.assert_close(fast.float(), slow.float(), rtol=BF16_ULP, atol=0.0)


class TestAgainstTheModules:
    @pytest.mark.parametrize("rows", ROWS)
    def test_rms_norm(self, native_ops, rows) -> None:
        norm, x = rms_norm(576), rows_of(rows, 576, seed=rows)
        assert_within_an_ulp_rarely(native_ops.norm(norm, x), norm(x))

    @pytest.mark.parametrize("rows", ROWS)
    def test_add_then_norm(self, native_ops, rows) -> None:
        norm, residual, delta = rms_norm(576), rows_of(rows, 576, seed=1), rows_of(rows, 576, seed=2)
        before = residual.clone()
        total, normed = native_ops.add_norm(norm, residual, delta)
        assert torch.equal(total, residual + delta)
        assert torch.equal(residual, before)
        assert_within_an_ulp_rarely(normed, norm(residual + delta))

    @pytest.mark.parametrize("rows", ROWS)
    def test_rotary_on_a_view_of_the_fused_projection(self, native_ops, rows) -> None:
        heads, kv_heads, dim = 9, 3, 64
        rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads, head_dim=dim))
        qkv = rows_of(rows, (heads + 2 * kv_heads) * dim, seed=rows).view(rows, heads + 2 * kv_heads, dim)
        cos, sin = rotary(qkv, torch.arange(1000, 1000 + rows)[None])
        cos, sin = cos.to(torch.bfloat16)[0, :, None, :], sin.to(torch.bfloat16)[0, :, None, :]
        expected = LayerOps().rotate(qkv[:, :heads + kv_heads], cos, sin)
        values = qkv[:, heads + kv_heads:].clone()
        rotated = native_ops.rotate(qkv[:, :heads + kv_heads], cos, sin)
        assert torch.equal(rotated, expected)
        assert torch.equal(qkv[:, heads + kv_heads:], values)  # the value heads are not touched

    @pytest.mark.parametrize("rows", ROWS)
    def test_silu_and_multiply(self, native_ops, rows) -> None:
        gate_up = rows_of(rows, 2 * 1536, seed=rows, scale=6.0)
        gate_up[0, :8] = torch.tensor([-100.0, -90.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 90.0])  # exp's range ends
        silu = ACT2FN["silu"]
        assert torch.equal(native_ops.act_mul(silu, gate_up), LayerOps().act_mul(silu, gate_up))


    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    @pytest.mark.parametrize("rows", ROWS)
    def test_k_and_v_rows_stored_at_their_slots(self, native_ops, rows, dtype) -> None:
        heads, kv_heads, dim, cache_slots = 9, 3, 64, 4096
        gen = torch.Generator().manual_seed(rows)
        qkv = torch.randn(rows, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
        k, v = qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]  # views of the fused projection
        slots = torch.randperm(cache_slots, generator=gen)[:rows]
        expected = [torch.randn(kv_heads, cache_slots, dim, generator=gen).to(dtype) for _ in range(2)]
        stored = [c.clone() for c in expected]
        LayerOps().store_kv(*expected, slots, k, v)
        native_ops.store_kv(*stored, slots, k, v)
        assert torch.equal(stored[0], expected[0]) and torch.equal(stored[1], expected[1])

    def test_a_store_it_cannot_address_is_left_to_torch(self, native_ops) -> None:
        k = torch.randn(4, 64, 3).transpose(1, 2)  # heads not side by side
        v = torch.randn(4, 3, 64)
        slots = torch.tensor([5, 9, 2, 7])
        expected = [torch.zeros(3, 16, 64) for _ in range(2)]
        stored = [c.clone() for c in expected]
        LayerOps().store_kv(*expected, slots, k, v)
        native_ops.store_kv(*stored, slots, k, v)
        assert torch.equal(stored[0], expected[0]) and torch.equal(stored[1], expected[1])
        assert expected[0].abs().sum() > 0


class TestFallback:
    def test_what_the_kernel_does_not_know_is_left_to_the_modules(self, native_ops) -> None:
        x = rows_of(5, 64, seed=3)
        layer_norm = torch.nn.LayerNorm(64).to(torch.bfloat16)
        assert torch.equal(native_ops.norm(layer_norm, x), layer_norm(x))
        norm32 = rms_norm(64).float()
        assert torch.equal(native_ops.norm(norm32, x.float()), norm32(x.float()))
        gelu = torch.nn.GELU()
        assert torch.equal(native_ops.act_mul(gelu, x), LayerOps().act_mul(gelu, x))

    def test_switched_off_or_without_a_compiler_it_is_the_modules(self, monkeypatch, tmp_path: Path) -> None:
        try:
            monkeypatch.setenv("HALFMOON_LAYER_OPS_KERNEL", "0")
            native.loaded.cache_clear()
            assert type(layer_ops(torch.device("cpu"))) is LayerOps
            monkeypatch.setenv("HALFMOON_LAYER_OPS_KERNEL", "1")
            monkeypatch.setenv("CC", "no-such-compiler")
            monkeypatch.setenv("HALFMOON_KERNEL_DIR", str(tmp_path / "cache"))
            monkeypatch.setattr(native, "KERNELS", kernel_sources_alone(tmp_path / "sources"))
            native.loaded.cache_clear()
            assert type(ops_module.layer_ops(torch.device("cpu"))) is LayerOps and not (tmp_path / "cache").exists()
        finally:
            monkeypatch.undo()
            native.loaded.cache_clear()


def greedy_with_logprobs(engine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    return tokens_and_logprobs(engine, prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                               logprobs=True))


class TestBuild:
    def test_every_kernel_is_built_once_into_the_cache(self, native_ops, monkeypatch, tmp_path: Path) -> None:
        monkeypatch.setenv("HALFMOON_KERNEL_DIR", str(tmp_path))
        first = native.build_all()
        assert sorted(path.name.split("-")[0] for path in first) == sorted(
            source.stem for source in native.KERNELS.glob("*.c"))
        stamps = [path.stat().st_mtime_ns for path in first]
        assert native.build_all() == first and [path.stat().st_mtime_ns for path in first] == stamps
        assert sorted(tmp_path.iterdir()) == sorted(first)  # no leftovers of the builds


    def test_a_cache_other_users_can_write_to_is_refused(self, native_ops, monkeypatch, tmp_path: Path) -> None:
        monkeypatch.setenv("HALFMOON_KERNEL_DIR", str(tmp_path))
        built = native.build_all()
        tmp_path.chmod(0o777)  # anyone could have swapped a library in
        with pytest.raises(RuntimeError, match="writable by other users"):
            native.build_all()
        tmp_path.chmod(0o755)
        built[0].chmod(0o666)
        with pytest.raises(RuntimeError, match="writable by other users"):
            native.build_all()
        built[0].chmod(0o755)
        assert native.build_all() == built


class TestEngine:
    def test_bfloat16_tokens_and_logprobs_with_the_kernel_match_the_modules(self, native_ops, tiny_llama: Path) -> None:
        prompts = random_prompts(1000, [5, 40, 77], seed=4)
        with_kernel = make_engine(tiny_llama, dtype="bfloat16")
        assert isinstance(with_kernel.runner.layer_ops, NativeLayerOps)
        without = make_engine(tiny_llama, dtype="bfloat16")
        without.runner.layer_ops = LayerOps()
        fast, slow = greedy_with_logprobs(with_kernel, prompts), greedy_with_logprobs(without, prompts)
        for (fast_tokens, fast_logprobs), (slow_tokens, slow_logprobs) in zip(fast, slow, strict=True):
            assert fast_tokens == slow_tokens
            torch.testing.assert_close(torch.tensor(fast_logprobs), torch.tensor(slow_logprobs), rtol=0.05, atol=0.05)
