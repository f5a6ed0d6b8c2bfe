"""Attention against the paged KV cache: the only part of the model the engine owns."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from halfmoon.engine.decode_kernel import DecodeBatch, DecodeKernel
from halfmoon.engine.prefill_kernel import PrefillBatch, PrefillKernel
from halfmoon.engine.seq_attention import SeqAttention


class PagedKVCache:
    """Per layer, K and V shaped ``[kv_heads, num_blocks * block_size, head_dim]`` (head-major).

    A token at ``position`` of a sequence lives in block ``block_table[position // block_size]``
    at row ``position % block_size``; ``slot = block * block_size + row`` flattens both. Head-major
    rows make the KV of consecutive blocks one strided slice per layer, so attention over a
    sequence whose blocks are consecutive reads the cache in place, without gathering a copy.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, 0], self.data[index, 1]

    def _slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        size = self.block_size
        rows = torch.arange(size, dtype=torch.long)
        blocks = torch.tensor(block_ids, dtype=torch.long)
        return (blocks[:, None] * size + rows).flatten()[:num_tokens].to(self.data.device)

    def blocks(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """KV of ``num_tokens`` tokens stored in ``block_ids``: ``[layers, 2, tokens, heads, dim]``."""
        return self.data.index_select(3, self._slots(block_ids, num_tokens)).transpose(2, 3)

    def layer_blocks(self, layer: int, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """One layer of :meth:`blocks`: ``[2, tokens, heads, dim]``."""
        return self.data[layer].index_select(2, self._slots(block_ids, num_tokens)).transpose(1, 2)

    def load_blocks(self, block_ids: list[int], kv: torch.Tensor, first_layer: int = 0) -> None:
        """Inverse of :meth:`blocks` for ``kv`` shaped ``[layers, 2, tokens, heads, dim]``: layers
        ``first_layer`` onwards (a pipeline stage holds a slice of them)."""
        slots = self._slots(block_ids, kv.shape[2])
        target = self.data[first_layer:first_layer + kv.shape[0]]
        target.index_copy_(3, slots, kv[:, :, : slots.numel()].transpose(2, 3).to(self.data.device, self.data.dtype))


class AttentionBatch(NamedTuple):
    """Where this step's tokens go (``slots[t]`` for flattened token ``t``) and what each sequence reads;
    ``decode`` the step's one-query sequences for the decode kernel, ``prefill`` its prompt chunks for the
    prefill kernel (None: SDPA for them)."""

    slots: torch.Tensor
    seqs: list[SeqAttention]
    decode: DecodeBatch | None = None
    prefill: PrefillBatch | None = None


class AttentionKernels(NamedTuple):
    """The C kernels an engine has (None: that kind of sequence stays on SDPA)."""

    decode: DecodeKernel | None = None
    prefill: PrefillKernel | None = None


SDPA_ONLY = AttentionKernels()


def _context(cache: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """``[1, kv_heads, context, dim]``: a view of the cache when the spans are one, else a copy."""
    if len(spans) == 1:
        start, end = spans[0]
        return cache[None, :, start:end]
    return torch.cat([cache[:, start:end] for start, end in spans], dim=1)[None]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: AttentionBatch, scale: float, kernels: AttentionKernels = SDPA_ONLY) -> torch.Tensor:
    """``q`` is ``[tokens, heads, dim]`` in flattened step order; returns ``[tokens, heads * dim]``.
    Each kernel given serves all of its kind of sequence (those of ``batch.decode``, ``batch.prefill``) in one
    call; SDPA serves the rest."""
    kv_heads, dim = k_cache.shape[0], q.shape[-1]
    decoded = (kernels.decode(q, k_cache, v_cache, batch.decode, scale)
               if kernels.decode is not None and batch.decode is not None else None)
    if decoded is not None and decoded.shape[0] == len(batch.seqs):  # a step of decodes only: rows in step order
        return decoded
    prefilled = (kernels.prefill(q, k_cache, v_cache, batch.prefill, scale)
                 if kernels.prefill is not None and batch.prefill is not None else None)
    if prefilled is not None and (decoded is not None or all(seq.query_len > 1 for seq in batch.seqs)):
        if decoded is not None and batch.decode is not None:  # every row had its kernel
            prefilled.index_copy_(0, batch.decode.rows, decoded)
        return prefilled
    outs, next_decoded = [], 0
    for seq in batch.seqs:
        if seq.query_len == 1 and decoded is not None:
            outs.append(decoded[next_decoded:next_decoded + 1])
            next_decoded += 1
            continue
        if seq.query_len > 1 and prefilled is not None:
            outs.append(prefilled[seq.query_start:seq.query_start + seq.query_len])
            continue
        k, v = _context(k_cache, seq.spans), _context(v_cache, seq.spans)
        if seq.query_len == 1:
            # One query sees every key: its heads sharing a KV head become that head's query rows,
            # so grouped-query attention needs neither a mask nor repeated K/V.
            qd = q[seq.query_start].reshape(1, kv_heads, -1, dim)
            # CUDA's attention kernels may return a strided output; reshape copies only then
            outs.append(F.scaled_dot_product_attention(qd, k, v, scale=scale).reshape(1, -1))
            continue
        qp = q[seq.query_start:seq.query_start + seq.query_len].transpose(0, 1)[None]
        op = F.scaled_dot_product_attention(qp, k, v, attn_mask=seq.mask, is_causal=seq.mask is None,
                                            scale=scale, enable_gqa=True)
        outs.append(op[0].transpose(0, 1).reshape(seq.query_len, -1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
