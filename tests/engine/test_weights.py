"""The serving form of the decoder's weights: fused and packed projections compute what the split ones do."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from halfmoon.engine.config import cpu_has_bf16
from halfmoon.engine.weights import Projection, serving_layers
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine

ROWS = (1, 8, 300)


def _linears(dtype: torch.dtype, bias: bool) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(64, out, bias=bias).to(dtype) for out in (64, 32, 32)]


class TestFusedProjection:
    @pytest.mark.parametrize("bias", [False, True])
    def test_float32_fused_and_packed_equals_split(self, bias: bool) -> None:
        linears = _linears(torch.float32, bias)
        fused = Projection.fuse(linears)
        assert fused.packed == torch.backends.mkldnn.is_available()
        with torch.inference_mode():
            for rows in ROWS:
                x = torch.randn(rows, 64)
                # oneDNN sums in another order than PyTorch: equal up to float32 rounding
                torch.testing.assert_close(fused(x), torch.cat([linear(x) for linear in linears], dim=-1))

    def test_a_missing_bias_counts_as_zero(self) -> None:
        linears = _linears(torch.float32, True)
        linears[1].bias = None
        x = torch.randn(4, 64)
        with torch.inference_mode():
            expected = torch.cat([linears[0](x), F.linear(x, linears[1].weight), linears[2](x)], dim=-1)
            torch.testing.assert_close(Projection.fuse(linears)(x), expected)


class TestPackedProjection:
    @pytest.mark.parametrize("bias", [False, True])
    def test_bfloat16_on_onednn_matches_plain_linear_bit_for_bit(self, bias: bool) -> None:
        weight = torch.randn(96, 64, dtype=torch.bfloat16)
        b = torch.randn(96, dtype=torch.bfloat16) if bias else None
        with mock.patch("halfmoon.engine.weights._kernel_for", lambda _weight: None):
            projection = Projection(weight, b)
        # Packed for oneDNN exactly where the CPU computes bfloat16 natively; the result is the same either way.
        # (The linear kernel, where it is taken, sums in its own order: test_linear_kernel.)
        assert projection.packed == cpu_has_bf16()
        with torch.inference_mode():
            for rows in ROWS:
                x = torch.randn(rows, 64, dtype=torch.bfloat16)
                assert torch.equal(projection(x), F.linear(x, weight, b))


class TestServingLayers:
    def test_takes_the_projections_over(self, tiny_models: dict[str, Path]) -> None:
        model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"])
        attn = model.model.layers[0].self_attn
        expected = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach().clone()
        layers = serving_layers(model.model.layers)
        assert len(layers) == len(model.model.layers)
        assert torch.equal(layers[0].qkv.bias, expected)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert not hasattr(model.model.layers[0].self_attn, name)  # not held twice
        assert not hasattr(model.model.layers[0].mlp, "gate_proj")

    def test_an_untied_bfloat16_head_is_held_once(self, tiny_models: dict[str, Path]) -> None:
        engine = make_engine(tiny_models["llama"], dtype="bfloat16")  # the tiny models' heads are untied
        assert (engine.model.get_output_embeddings() is None) == engine.runner.lm_head.packed
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert [len(out) for out in engine.generate([[1, 2, 3], [4, 5]], params)] == [4, 4]
