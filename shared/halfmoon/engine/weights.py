"""The decoder's weights laid out for serving: one projection for Q, K and V, one for the MLP's gate
and up halves, each pre-packed once for the CPU's matrix library.

A decode step multiplies a few rows by every weight matrix of the model, so its cost is reading the
weights and the calls that do it: fusing halves the calls of the attention input and the MLP input,
and a pre-packed weight spares oneDNN re-laying it out on every call (a third less time per bfloat16
matrix at 8 rows on an AMX CPU, bit for bit the same result). float32 is packed too: on an AMD CPU
with AVX2 only, PyTorch's float32 matmul (MKL) took 2.4 ms for the MLP's gate-up projection at 8
rows and 52 ms for the 49,152-row vocabulary head, oneDNN's packed kernel 0.8 and 11.6 ms; it sums
in another order (results differ in the last bits, greedy tokens stayed the same in the tests that
compare them with transformers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol, cast

import torch
import torch.nn.functional as F

from halfmoon.engine.config import cpu_has_bf16


def _can_pack(weight: torch.Tensor) -> bool:
    """float32, or bfloat16 on a CPU that computes it natively (elsewhere oneDNN emulates it)."""
    return (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and cpu_has_bf16())))


class Projection:
    """``x @ weight.T + bias`` for ``x`` shaped ``[tokens, in_features]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.bias = bias
        self.packed = _can_pack(weight)
        # NOTE: the packed tensor is in oneDNN's blocked layout: only _linear_pointwise may read it.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 8) if self.packed else weight

    @classmethod
    def fuse(cls, linears: Sequence[torch.nn.Linear]) -> Projection:
        """One projection whose output is the outputs of ``linears`` side by side."""
        weight = torch.cat([linear.weight.detach() for linear in linears])
        biases = [linear.bias for linear in linears]
        if all(b is None for b in biases):
            return cls(weight, None)
        bias = torch.cat([b.detach() if b is not None else weight.new_zeros(lin.out_features)
                          for b, lin in zip(biases, linears)])
        return cls(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            if x.shape[0] == 1:
                # oneDNN takes another kernel for one row, which sums a long row (1,536 inputs: SmolLM2's MLP
                # down projection) in another order on AVX-512 CPUs: a row must round the same whatever
                # shares its call (exact migration rests on it), so one row goes in as two
                return self._packed(x.expand(2, -1))[:1]
            return self._packed(x)
        return F.linear(x, self.weight, self.bias)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class HFAttention(Protocol):
    """The attributes of a Llama-family attention module that serving reads."""

    q_proj: torch.nn.Linear
    k_proj: torch.nn.Linear
    v_proj: torch.nn.Linear
    o_proj: torch.nn.Linear
    scaling: float


class HFMLP(Protocol):
    gate_proj: torch.nn.Linear
    up_proj: torch.nn.Linear
    down_proj: torch.nn.Linear
    act_fn: Callable[[torch.Tensor], torch.Tensor]


class HFDecoderLayer(Protocol):
    input_layernorm: torch.nn.Module
    post_attention_layernorm: torch.nn.Module
    self_attn: HFAttention
    mlp: HFMLP


class HFConfig(Protocol):
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int


class HFDecoder(Protocol):
    """A Llama-family model's decoder stack (``LlamaModel`` and its kin)."""

    layers: Iterable[HFDecoderLayer]  # a ModuleList
    embed_tokens: torch.nn.Embedding
    norm: torch.nn.Module
    rotary_emb: torch.nn.Module


class HFCausalLM(Protocol):
    """A Llama-family causal LM (``LlamaForCausalLM`` and its kin), as far as serving reads it."""

    model: HFDecoder
    config: HFConfig

    def get_input_embeddings(self) -> torch.nn.Embedding: ...

    def get_output_embeddings(self) -> torch.nn.Linear: ...

    def set_output_embeddings(self, value: torch.nn.Module | None) -> None: ...


def llama_family(model: torch.nn.Module) -> HFCausalLM:
    """``model`` typed as the Llama-family causal LM that the loader admits (SUPPORTED_ARCHITECTURES):
    torch types every submodule and attribute found by ``nn.Module.__getattr__`` as ``Tensor | Module``."""
    return cast(HFCausalLM, model)


class ServingLayer(NamedTuple):
    """One decoder layer's modules and fused projections. ``qkv``'s output is the query heads, then the
    key heads, then the value heads; ``gate_up``'s is the gate half, then the up half."""

    input_norm: torch.nn.Module
    qkv: Projection
    qk_norm: tuple[torch.nn.Module, torch.nn.Module] | None  # per-head query and key norms of Qwen3
    o: Projection
    scaling: float
    post_norm: torch.nn.Module
    gate_up: Projection
    act: Callable[[torch.Tensor], torch.Tensor]
    down: Projection


def serving_layers(layers: Iterable[HFDecoderLayer]) -> list[ServingLayer]:
    """The serving form of a Llama-family model's decoder layers. Takes their weights over: each HF
    layer's projections are dropped from it, so the model is not held in memory twice."""
    out: list[ServingLayer] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        out.append(ServingLayer(
            input_norm=layer.input_layernorm,
            qkv=Projection.fuse([attn.q_proj, attn.k_proj, attn.v_proj]),
            qk_norm=(attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") and hasattr(attn, "k_norm") else None,
            o=Projection.fuse([attn.o_proj]), scaling=attn.scaling,
            post_norm=layer.post_attention_layernorm,
            gate_up=Projection.fuse([mlp.gate_proj, mlp.up_proj]), act=mlp.act_fn,
            down=Projection.fuse([mlp.down_proj]),
        ))
        for module, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                delattr(module, name)
    return out
