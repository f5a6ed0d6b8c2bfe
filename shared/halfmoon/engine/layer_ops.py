"""The elementwise math of a decoder layer: RMSNorm, residual adds, rotary embedding, SiLU-and-multiply,
and the store of its K and V rows into the paged cache.

In PyTorch each is several operators (RMSNorm alone converts to float32, squares, averages, scales and
converts back), each a pass over the step's rows and, at a decode step's few rows, mostly dispatch.
On a CPU in bfloat16 a C kernel (``kernels/layer_ops.c``) does each in one pass, rounding every
intermediate through bfloat16 where PyTorch stores one, so the result is what transformers' modules
compute. Elsewhere (float32, CUDA, modules it does not know, no C compiler,
``HALFMOON_LAYER_OPS_KERNEL=0``) the modules themselves run. The store is a copy, in C for CPU rows of
any dtype: two ``index_copy_`` calls a layer cost 45 us at a decode step's 8 rows, 3% of the step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Protocol, TypeGuard

import torch
from transformers.models.llama.modeling_llama import rotate_half

from halfmoon.engine import native
from halfmoon.engine.native import pointer

Activation = Callable[[torch.Tensor], torch.Tensor]
# Norms whose forward is LlamaRMSNorm's: float32 mean of squares, rsqrt, scale, weight times bfloat16.
RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
SILUS = frozenset({"SiLU", "SiLUActivation"})


class RMSNormWeights(Protocol):
    """What the kernel reads of one of RMS_NORMS."""

    weight: torch.Tensor
    variance_epsilon: float


class LayerOps:
    """Contract: every method returns what the given transformers module (or the reference formula)
    returns for the same input, bit for bit; inputs are ``[tokens, ...]`` rows of the step."""

    def norm(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x)

    def add_norm(self, module: torch.nn.Module, residual: torch.Tensor,
                 delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + delta, module(residual + delta))``; ``residual`` is left as it was."""
        total = residual + delta
        return total, module(total)

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``qk`` ``[tokens, heads, dim]`` by ``cos``/``sin`` ``[tokens, 1, dim]``;
        may write into ``qk``, whose storage the caller gives up."""
        return qk * cos + rotate_half(qk) * sin

    def act_mul(self, act: Activation, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` for ``gate_up`` ``[tokens, 2 * half]``, the gate half first."""
        half = gate_up.shape[-1] // 2
        return act(gate_up[:, :half]) * gate_up[:, half:]

    def store_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """``k``/``v`` ``[tokens, kv_heads, head_dim]`` into the head-major caches ``[kv_heads, slots, head_dim]``
        at ``slots``."""
        k_cache.index_copy_(1, slots, k.transpose(0, 1))
        v_cache.index_copy_(1, slots, v.transpose(0, 1))


class NativeLayerOps(LayerOps):
    """The C kernel's one-pass forms, for CPU bfloat16 rows of the norms and activation it knows."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._rms_norm, self._rotary, self._silu_mul = library.rms_norm, library.rotary, library.silu_mul
        self._store_kv = library.store_kv
        for function in (self._rms_norm, self._rotary, self._silu_mul, self._store_kv):
            function.restype = None

    def _norm_into(self, module: RMSNormWeights, x: torch.Tensor, residual: torch.Tensor | None,
                   total: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty_like(x)
        rows, dim = x.shape
        self._rms_norm(pointer(x), pointer(residual), pointer(total), pointer(module.weight), pointer(out), ctypes.c_long(rows),
                       dim, ctypes.c_float(module.variance_epsilon), torch.get_num_threads())
        return out

    def norm(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not (_fits(x) and known_norm(module)):
            return super().norm(module, x)
        return self._norm_into(module, x, None, None)

    def add_norm(self, module: torch.nn.Module, residual: torch.Tensor,
                 delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not (_fits(residual) and _fits(delta) and known_norm(module)):
            return super().add_norm(module, residual, delta)
        total = torch.empty_like(residual)
        return total, self._norm_into(module, delta, residual, total)

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tokens, heads, dim = qk.shape
        if (qk.dtype != torch.bfloat16 or qk.device.type != "cpu" or qk.stride(2) != 1 or qk.stride(1) != dim
                or dim % 2 or not (cos.is_contiguous() and sin.is_contiguous()) or cos.dtype != qk.dtype):
            return super().rotate(qk, cos, sin)
        self._rotary(pointer(qk), ctypes.c_long(qk.stride(0)), pointer(cos), pointer(sin), ctypes.c_long(tokens), heads,
                     dim, torch.get_num_threads())
        return qk

    def act_mul(self, act: Activation, gate_up: torch.Tensor) -> torch.Tensor:
        if not _fits(gate_up) or type(act).__name__ not in SILUS:
            return super().act_mul(act, gate_up)
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self._silu_mul(pointer(gate_up), pointer(out), ctypes.c_long(rows), ctypes.c_long(width // 2),
                       torch.get_num_threads())
        return out

    def store_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        tokens, kv_heads, dim = k.shape
        if not (_rows_of_heads(k) and _rows_of_heads(v) and k_cache.is_contiguous() and v_cache.is_contiguous()
                and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and k.device.type == k_cache.device.type == "cpu"
                and slots.dtype == torch.long and slots.is_contiguous() and k_cache.shape[0] == kv_heads
                and k_cache.shape[2] == dim and v_cache.shape == k_cache.shape and v.shape == k.shape):
            return super().store_kv(k_cache, v_cache, slots, k, v)
        self._store_kv(pointer(k), ctypes.c_long(k.stride(0)), pointer(v), ctypes.c_long(v.stride(0)), pointer(k_cache),
                       pointer(v_cache), ctypes.c_long(k_cache.shape[1]), pointer(slots), ctypes.c_long(tokens), kv_heads,
                       dim, k.element_size())


def layer_ops(device: torch.device) -> LayerOps:
    """The kernel's forms on a CPU where the kernel builds, else the modules'."""
    library = native.library("layer_ops") if device.type == "cpu" else None
    return NativeLayerOps(library) if library is not None else LayerOps()


def known_norm(module: torch.nn.Module) -> TypeGuard[RMSNormWeights]:
    weight = module.weight
    return (type(module).__name__ in RMS_NORMS and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.is_contiguous())


def _fits(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous()


def _rows_of_heads(x: torch.Tensor) -> bool:
    """``[tokens, heads, dim]`` with each token's heads side by side (tokens any distance apart)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]

