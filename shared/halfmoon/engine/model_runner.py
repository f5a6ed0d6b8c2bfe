"""Runs the transformers modules of a Llama-family model over one scheduled step.

Embeddings, projections, rotary, norms, MLP and lm_head are the reference modules, so
numerics match transformers; attention and the cache are ours (paged).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from itertools import accumulate

import torch
from halfmoon.engine.attention import AttentionBatch, PagedKVCache, paged_attention
from halfmoon.engine.block_manager import BlockManager
from halfmoon.engine.hooks import LayerHook
from halfmoon.engine.scheduler import ScheduledChunk
from transformers.models.llama.modeling_llama import rotate_half


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, blocks: BlockManager) -> None:
        self.model = model
        self.decoder = model.model
        self.cache = cache
        self.blocks = blocks
        self.device = cache.data.device
        config = model.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.layer_hook = LayerHook()

    def _batch(self, chunks: Seq[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """Decode chunks must come first in ``chunks``."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[tuple[int, int, int, torch.Tensor]] = []
        for seq, start, n in chunks:
            end = start + n
            if n == 1:
                decode_tables.append(seq.block_table)
                decode_lens.append(end)
            else:
                used = seq.block_table[: -(-end // self.blocks.block_size)]
                prefills.append((len(ids), n, end, torch.tensor(used, device=self.device)))
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self.blocks.slot(seq, p) for p in range(start, end))
        width = max((len(t) for t in decode_tables), default=0)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], device=self.device,
                              dtype=torch.long).reshape(len(decode_tables), width)
        batch = AttentionBatch(
            slots=torch.tensor(slots, device=self.device),
            num_decode=len(decode_tables),
            decode_tables=tables,
            decode_lens=torch.tensor(decode_lens, device=self.device),
            prefills=prefills,
        )
        as_tensor = lambda xs: torch.tensor(xs, device=self.device, dtype=torch.long)  # noqa: E731
        return as_tensor(ids), as_tensor(positions), batch

    @torch.inference_mode()
    def forward(self, chunks: Seq[ScheduledChunk]) -> torch.Tensor:
        """Compute every chunk's tokens into the cache; logits (float32) for the chunks that sample."""
        ordered = sorted(chunks, key=lambda c: c.num_tokens != 1)
        assert list(ordered) == list(chunks), "decode chunks must lead the step"
        ids, positions, batch = self._batch(chunks)
        hidden = self.decoder.embed_tokens(ids)
        cos, sin = self.decoder.rotary_emb(hidden[None], positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        tokens = ids.shape[0]
        for index, layer in enumerate(self.decoder.layers):
            attn = layer.self_attn
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            q = attn.q_proj(hidden).view(tokens, self.num_heads, self.head_dim)
            k = attn.k_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            self.layer_hook.before_layer(index, chunks, self.cache)
            self.cache.write(index, batch.slots, k, v)
            k_cache, v_cache = self.cache.layer(index)
            out = paged_attention(q, k_cache, v_cache, batch, attn.scaling)
            self.layer_hook.after_layer(index, chunks, self.cache)
            hidden = residual + attn.o_proj(out.reshape(tokens, -1))
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        ends = list(accumulate(c.num_tokens for c in chunks))
        last = torch.tensor([end - 1 for end, c in zip(ends, chunks) if c.samples], device=self.device,
                            dtype=torch.long)
        hidden = self.decoder.norm(hidden.index_select(0, last))
        return self.model.lm_head(hidden).float()
