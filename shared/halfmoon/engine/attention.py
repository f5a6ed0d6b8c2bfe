"""Attention against the paged KV cache: the only part of the model the engine owns."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class PagedKVCache:
    """Per-layer K and V block tensors shaped ``[num_blocks, block_size, kv_heads, head_dim]``.

    A token at ``position`` of a sequence lives in block ``block_table[position // block_size]``
    at row ``position % block_size``; ``slot = block * block_size + row`` flattens both.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, 0], self.data[index, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_cache, v_cache = self.layer(layer)
        k_cache.view(-1, *k_cache.shape[2:])[slots] = k
        v_cache.view(-1, *v_cache.shape[2:])[slots] = v

    def blocks(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """KV of ``num_tokens`` tokens stored in ``block_ids``: ``[layers, 2, tokens, heads, dim]``."""
        index = torch.tensor(block_ids, device=self.data.device, dtype=torch.long)
        picked = self.data.index_select(2, index)
        return picked.flatten(2, 3)[:, :, :num_tokens]

    def load_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Inverse of :meth:`blocks` for ``kv`` shaped ``[layers, 2, tokens, heads, dim]``."""
        tokens = kv.shape[2]
        for i, block in enumerate(block_ids):
            rows = kv[:, :, i * self.block_size:(i + 1) * self.block_size]
            self.data[:, :, block, : rows.shape[2]] = rows.to(self.data.device, self.data.dtype)
            if (i + 1) * self.block_size >= tokens:
                break


class AttentionBatch(NamedTuple):
    """Where this step's tokens go and what they attend to.

    ``slots[t]`` is the cache slot of flattened token ``t``. Decode sequences (one query
    token each) are the first ``num_decode`` entries, batched through ``decode_tables`` and
    ``decode_lens``; each prefill chunk is ``(query_start, query_len, context_len, table)``.
    """

    slots: torch.Tensor
    num_decode: int
    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    prefills: list[tuple[int, int, int, torch.Tensor]]


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``[B, blocks]`` tables -> ``[B, heads, blocks * block_size, dim]`` contiguous KV."""
    gathered = cache[tables]
    return gathered.flatten(1, 2).transpose(1, 2)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: AttentionBatch, scale: float) -> torch.Tensor:
    """``q`` is ``[tokens, heads, dim]`` in flattened step order; returns the same shape."""
    out = torch.empty_like(q)
    if batch.num_decode:
        qd = q[: batch.num_decode].unsqueeze(2)
        k, v = _gather(k_cache, batch.decode_tables), _gather(v_cache, batch.decode_tables)
        positions = torch.arange(k.shape[2], device=q.device)
        mask = (positions[None, :] < batch.decode_lens[:, None])[:, None, None, :]
        od = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[: batch.num_decode] = od.squeeze(2)
    for start, length, context, table in batch.prefills:
        qp = q[start:start + length].transpose(0, 1).unsqueeze(0)
        k = _gather(k_cache, table[None])[:, :, :context]
        v = _gather(v_cache, table[None])[:, :, :context]
        if context == length:
            op = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            rows = torch.arange(context - length, context, device=q.device)
            mask = rows[:, None] >= torch.arange(context, device=q.device)[None, :]
            op = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + length] = op.squeeze(0).transpose(0, 1)
    return out
