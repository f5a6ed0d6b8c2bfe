"""How much host memory an engine's fixed parts hold: what its process's memory bound is built from."""

from __future__ import annotations

from typing import NamedTuple

import torch


class HostMemory(NamedTuple):
    """Bytes in host memory (a GPU's tensors count 0): the weights, the paged KV cache (which holds the
    local prefix cache too) and the most one step's working tensors take; ``block_bytes`` is one KV block
    in the pool's format."""

    weights: int
    kv_cache: int
    step: int
    block_bytes: int


def host_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the host memory under ``tensors``, each storage once (a tied head is the embedding). A weight
    packed for oneDNN is opaque (no storage to ask): its elements are counted, its blocking's padding not."""
    storages = {}
    for t in tensors:
        if t.device.type != "cpu":
            continue
        if t.layout == torch.strided:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        else:
            storages[id(t)] = t.numel() * t.element_size()
    return sum(storages.values())


def step_working_bytes(*, max_num_batched_tokens: int, prefill_chunk_size: int, max_num_seqs: int,
                       hidden_size: int, intermediate_size: int, num_heads: int, vocab_size: int,
                       max_model_len: int, dtype_bytes: int) -> int:
    """The most one engine step holds besides weights and KV: a layer's activations for the step's tokens
    (hidden states, q/k/v and output, the MLP's gate, up and product, twice over for the residual stream
    and the next layer's input), one prompt chunk's float32 attention scores and mask against its whole
    context, and the float32 logits of every sequence, with the sampler's copy."""
    activations = max_num_batched_tokens * (6 * hidden_size + 3 * intermediate_size) * 2 * dtype_bytes
    scores = prefill_chunk_size * max_model_len * (num_heads * 4 + 1)
    logits = max_num_seqs * vocab_size * 4 * 2
    return activations + scores + logits
