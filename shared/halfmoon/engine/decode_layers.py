"""A step of decodes through the decoder layers in one call of a C kernel (``kernels/decode_layers.c``).

Why: ``halfmoon up`` runs its engines with OpenMP's passive wait, so that a busy process beside them costs
its share of the cores and no more (docs/BENCHMARKS.md). Then every parallel region wakes the other
threads through the kernel, and a decode step made five a layer (the projections and the attention): on a
2-core machine a third of the step went to waking up. The kernel runs all of a step's layers in one
region, its threads meeting at barriers that spin briefly before they sleep.

It computes what the engine's separate kernels compute, with their code, bit for bit: it is taken only
where every one of them would run (bfloat16 on a CPU whose projections are ``kernels/linear.c``'s, with
the decode attention and layer-ops kernels loaded, a Llama-family layer with RMSNorm and SiLU and no
per-head norms), for steps whose every row is a decode and whose layer hooks have nothing to do.
``HALFMOON_DECODE_LAYERS_KERNEL=0`` switches it off.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import cast

import torch

from halfmoon.engine import native
from halfmoon.engine.attention import AttentionBatch, PagedKVCache
from halfmoon.engine.layer_ops import SILUS, RMSNormWeights, known_norm
from halfmoon.engine.native import pointer
from halfmoon.engine.weights import Projection, ServingLayer

_WEIGHTS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias", "down",
            "down_bias")


class _Layer(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_void_p) for name in _WEIGHTS), ("input_eps", ctypes.c_float),
                ("post_eps", ctypes.c_float), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("intermediate", ctypes.c_int), ("cache_slots", ctypes.c_long),
                ("scale", ctypes.c_float)]


class DecodeLayers:
    """Contract: ``__call__`` returns what the layers compute one by one, with the engine's own kernels, for a
    step of decodes only, bit for bit, having stored each row's K and V in the cache as they do."""

    def __init__(self, library: ctypes.CDLL, layers: Sequence[ServingLayer], cache: PagedKVCache, heads: int,
                 kv_heads: int, head_dim: int) -> None:
        self._run = library.decode_layers
        self._run.restype = ctypes.c_int
        first = layers[0]
        self._layers = (_Layer * len(layers))()
        for struct, (index, layer) in zip(self._layers, enumerate(layers), strict=True):
            k_cache, v_cache = cache.layer(index)
            # decode_layers() took only known_norm()s
            input_norm, post_norm = cast(RMSNormWeights, layer.input_norm), cast(RMSNormWeights, layer.post_norm)
            for name, tensor in (("input_norm", input_norm.weight), ("post_norm", post_norm.weight),
                                 *_projection("qkv", layer.qkv), *_projection("o", layer.o),
                                 *_projection("gate_up", layer.gate_up), *_projection("down", layer.down),
                                 ("k_cache", k_cache), ("v_cache", v_cache)):
                setattr(struct, name, tensor.data_ptr() if tensor is not None else None)
            struct.input_eps, struct.post_eps = input_norm.variance_epsilon, post_norm.variance_epsilon
        # the weights and caches stay where they are for the engine's life: the structs point into them
        self._keep = (layers, cache)
        self._shape = _Shape(first.o.out_features, heads, kv_heads, head_dim, first.gate_up.out_features // 2,
                             cache.data.shape[3], first.scaling)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch,
                 layers: range) -> torch.Tensor | None:
        """``hidden`` ``[rows, hidden]``, the input of ``layers.start``, through ``layers``; ``cos``/``sin``
        ``[rows, head_dim]``. None where the step is not one it takes (then nothing was computed)."""
        decode = batch.decode
        rows = hidden.shape[0]
        if (decode is None or decode.rows.shape[0] != rows or hidden.dtype != torch.bfloat16
                or cos.dtype != torch.bfloat16 or not (cos.is_contiguous() and sin.is_contiguous())):
            return None
        out = hidden.clone(memory_format=torch.contiguous_format)
        failed = self._run(ctypes.byref(self._layers, layers.start * ctypes.sizeof(_Layer)), len(layers),
                           ctypes.byref(self._shape), pointer(out), rows, pointer(cos), pointer(sin),
                           pointer(batch.slots), pointer(decode.spans), pointer(decode.offsets),
                           torch.get_num_threads())
        if failed == -2:
            raise MemoryError("decode_layers: no memory for a step's buffers")
        return None if failed else out


def _projection(name: str, projection: Projection) -> tuple[tuple[str, torch.Tensor], tuple[str, torch.Tensor | None]]:
    return (name, projection.weight), (f"{name}_bias", projection.bias)


def decode_layers(layers: Sequence[ServingLayer], cache: PagedKVCache, heads: int, kv_heads: int,
                  head_dim: int) -> DecodeLayers | None:
    """The kernel for these layers, where each of its parts is what the engine runs for them apart; else None."""
    data = cache.data
    if not layers or data.dtype != torch.bfloat16 or data.device.type != "cpu" or not data.is_contiguous():
        return None
    if any(layer.qk_norm is not None or type(layer.act).__name__ not in SILUS
           or not (known_norm(layer.input_norm) and known_norm(layer.post_norm))
           or any(p.kernel is None for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
           or layer.scaling != layers[0].scaling for layer in layers):
        return None
    if any(native.library(name) is None for name in ("decode_attention", "layer_ops")):
        return None
    library = native.library("decode_layers")
    return DecodeLayers(library, layers, cache, heads, kv_heads, head_dim) if library is not None else None
