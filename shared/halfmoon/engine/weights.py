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

bfloat16 on a CPU with AVX512-BF16 and no AMX goes to the engine's own kernel (``kernels/linear.c``)
instead: on a 2-core AVX-512 EPYC with the passive wait ``up`` sets, at a decode step's 8 rows, the
kernel, asking for the weights ahead, ran SmolLM2's projections 1.22x faster than oneDNN's inner product
(``benchmarks.projections``); a decode step 1.11-1.19x faster, a prompt's steps level
(``benchmarks.decode_step --onednn-baseline``). Its rows each sum in one order
whatever rows share the call. ``HALFMOON_LINEAR_KERNEL=0`` keeps oneDNN.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol, cast

import torch
import torch.nn.functional as F

from halfmoon.engine import kernel_build, native
from halfmoon.engine.config import cpu_has_bf16
from halfmoon.engine.native import pointer

KERNEL_BLOCK = 16  # outputs per block of kernels/linear.c's packed weight


class LinearKernel:
    """``kernels/linear.c``: bfloat16 rows times a weight packed for it, each row summed in one fixed order."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._linear = library.linear
        self._linear.restype = None

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[n, k]`` (``k`` even) as ``[blocks of 16 outputs][k / 2][16][2]``, zero padded to whole
        blocks."""
        n, k = weight.shape
        padded = weight.new_zeros(-(-n // KERNEL_BLOCK) * KERNEL_BLOCK, k)
        padded[:n] = weight
        return padded.view(-1, KERNEL_BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, outputs: int, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        rows, k = x.shape
        y = x.new_empty(rows, outputs)
        self._linear(pointer(x), ctypes.c_long(rows), ctypes.c_long(k), pointer(packed), ctypes.c_long(outputs),
                     pointer(bias), pointer(y), torch.get_num_threads())
        return y


def _kernel_for(weight: torch.Tensor) -> LinearKernel | None:
    """The kernel for bfloat16 on a CPU with AVX512-BF16 but no AMX. There, at a decode step's 8 rows,
    oneDNN read SmolLM2's weights at 13-19 GB/s where the machine copies at 32-34. With AMX, oneDNN's
    tiles multiply a prompt's rows several times faster than the kernel's vector products can."""
    if not cpu_has_bf16() or "amx_bf16" in kernel_build.cpu_flags():
        return None
    return linear_kernel(weight)


def linear_kernel(weight: torch.Tensor) -> LinearKernel | None:
    """``kernels/linear.c`` for a bfloat16 CPU weight whatever the CPU's instructions (its portable path
    without AVX512-BF16; None: another weight, or the kernel not built). Tests and benchmarks put every
    engine's projections on it by standing it in for ``_kernel_for``."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[1] % 2:
        return None
    library = native.library("linear")
    return LinearKernel(library) if library is not None else None


def _can_pack(weight: torch.Tensor) -> bool:
    """float32, or bfloat16 on a CPU that computes it natively (elsewhere oneDNN emulates it)."""
    return (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and cpu_has_bf16())))


class Projection:
    """``x @ weight.T + bias`` for ``x`` shaped ``[tokens, in_features]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.bias = bias
        self.out_features = weight.shape[0]
        self.kernel = _kernel_for(weight)
        self.packed = self.kernel is not None or _can_pack(weight)
        # NOTE: a packed tensor is in the kernel's or oneDNN's layout: only that one may read it.
        if self.kernel is not None:
            self.weight = LinearKernel.pack(weight)
        elif self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        else:
            self.weight = weight

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
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.out_features, self.bias)
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
