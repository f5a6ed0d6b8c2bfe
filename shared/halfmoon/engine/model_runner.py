"""Runs the transformers modules of a Llama-family model over one scheduled step.

Embeddings, rotary, norms and activations are the reference modules and the projections their
weights (fused and packed for serving, engine/weights.py), so numerics match transformers;
attention and the cache are ours (paged).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from halfmoon.engine.attention import AttentionBatch, AttentionKernels, PagedKVCache, paged_attention
from halfmoon.engine.block_manager import BlockManager
from halfmoon.engine.decode_kernel import DecodeBatch, decode_kernel
from halfmoon.engine.decode_layers import decode_layers
from halfmoon.engine.hooks import LayerHook
from halfmoon.engine.layer_ops import layer_ops
from halfmoon.engine.prefill_kernel import PrefillBatch, prefill_kernel, sdpa_is_faster
from halfmoon.engine.seq_attention import SeqAttention
from halfmoon.engine.sequence import ScheduledChunk
from halfmoon.engine.weights import Projection, llama_family, serving_layers


def _spans(runs: list[list[int]], block_size: int, context: int) -> tuple[tuple[int, int], ...]:
    """The first ``context`` slots of a block table given as runs of consecutive blocks."""
    spans = []
    for first, count in runs:
        start = first * block_size
        take = min(count * block_size, context)
        spans.append((start, start + take))
        context -= take
        if context <= 0:
            break
    return tuple(spans)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, blocks: BlockManager) -> None:
        self.model = model
        llm = llama_family(model)
        self.decoder = llm.model
        self.cache = cache
        self.blocks = blocks
        self.device = cache.data.device
        config = llm.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.layers = serving_layers(self.decoder.layers)
        head = llm.get_output_embeddings()
        self.lm_head = Projection(head.weight.detach(), head.bias)
        if self.lm_head.packed and head.weight is not llm.get_input_embeddings().weight:
            llm.set_output_embeddings(None)  # an untied head is held once, packed; a tied one is the embedding
        self.layer_hook = LayerHook()
        cpu = self.device.type == "cpu"
        prefill = prefill_kernel() if cpu and not sdpa_is_faster(cache.data.dtype) else None
        self.kernels = AttentionKernels(decode_kernel() if cpu else None, prefill)
        self.layer_ops = layer_ops(self.device)
        self.decode_layers = (decode_layers(self.layers, cache, self.num_heads, self.num_kv_heads, self.head_dim)
                              if cpu else None)

    def serving_weights(self) -> list[torch.Tensor]:
        """The weights the serving layers and the head took over from the model (packed where they could be)."""
        projections = [self.lm_head, *(p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up,
                                                                             layer.down))]
        return [tensor for p in projections for tensor in (p.weight, p.bias) if tensor is not None]

    def _batch(self, chunks: Seq[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, torch.Tensor]:
        """Token ids, positions, attention layout and the rows whose logits are sampled."""
        size = self.blocks.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampled: list[int] = []
        seqs: list[SeqAttention] = []
        for seq, start, n in chunks:
            end = start + n
            table = seq.block_table
            # Past the prompt's full blocks each token attends as a decode step does, one query alone, so
            # its KV is bit for bit the same however the steps are cut: a migrated request recomputes
            # exactly these tokens (the pool has the full prompt blocks) and gets the KV the first had.
            split = min(max(start, seq.num_prompt_tokens - seq.num_prompt_tokens % size), end)
            if split - start > 1:
                mask = None
                if start:  # a chunk after cached context: causal diagonal offset by ``start``
                    mask = (torch.arange(start, split, device=self.device)[:, None]
                            >= torch.arange(split, device=self.device))
                seqs.append(SeqAttention(len(ids), split - start, _spans(seq.block_runs, size, split), mask))
            else:
                split = start
            seqs.extend(SeqAttention(len(ids) + p - start, 1, _spans(seq.block_runs, size, p + 1), None)
                        for p in range(split, end))
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // size] * size + p % size for p in range(start, end))
            if end == seq.num_tokens:
                sampled.append(len(ids) - 1)
        # One host-to-device copy for everything per-token.
        packed = torch.tensor([ids, positions, slots], dtype=torch.long).to(self.device)
        last = torch.tensor(sampled, dtype=torch.long).to(self.device)
        decode = DecodeBatch.of(seqs) if self.kernels.decode is not None else None
        prefill = PrefillBatch.of(seqs) if self.kernels.prefill is not None else None
        return packed[0], packed[1], AttentionBatch(packed[2], seqs, decode, prefill), last

    @torch.inference_mode()
    def forward(self, chunks: Seq[ScheduledChunk]) -> torch.Tensor:
        """Compute every chunk's tokens into the cache; logits (float32) for the chunks that sample."""
        ids, positions, batch, last = self._batch(chunks)
        hidden = self._layers(self.decoder.embed_tokens(ids), positions, batch, chunks, range(len(self.layers)))
        return self._logits(hidden, last)

    @torch.inference_mode()
    def forward_stage(self, chunk: ScheduledChunk, layers: range, hidden: torch.Tensor | None,
                      logits: bool) -> torch.Tensor:
        """One pipeline stage over one chunk: layers ``layers`` only, their KV into the cache. ``hidden`` is
        the input of ``layers.start`` (None: the stage starts at the embeddings); returns the output of the
        stage's last layer, or with ``logits`` (the stage ends the model) the chunk's last row's logits."""
        ids, positions, batch, last = self._batch([chunk])
        start = self.decoder.embed_tokens(ids) if hidden is None else hidden.to(self.device)
        out = self._layers(start, positions, batch, [chunk], layers)
        return self._logits(out, last) if logits else out

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.decoder.norm(hidden.index_select(0, rows))).float()

    def _layers(self, hidden: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                chunks: Seq[ScheduledChunk], layers: range) -> torch.Tensor:
        cos, sin = self.decoder.rotary_emb(hidden[None], positions[None])
        if self.decode_layers is not None and self.layer_hook.idle(chunks):
            out = self.decode_layers(hidden, cos[0], sin[0], batch, layers)
            if out is not None:
                return out
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        tokens, heads, kv_heads = hidden.shape[0], self.num_heads, self.num_kv_heads
        ops = self.layer_ops
        normed = ops.norm(self.layers[layers.start].input_norm, hidden)
        for index in layers:
            layer = self.layers[index]
            qkv = layer.qkv(normed).view(tokens, heads + 2 * kv_heads, self.head_dim)
            if layer.qk_norm is not None:
                q_norm, k_norm = layer.qk_norm
                qkv = torch.cat([q_norm(qkv[:, :heads]), k_norm(qkv[:, heads:heads + kv_heads]),
                                 qkv[:, heads + kv_heads:]], dim=1)
            qk = ops.rotate(qkv[:, :heads + kv_heads], cos, sin)  # one rotation for the query and key heads
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
            self.layer_hook.before_layer(index, chunks, self.cache)
            k_cache, v_cache = self.cache.layer(index)
            ops.store_kv(k_cache, v_cache, batch.slots, k, v)
            out = paged_attention(q, k_cache, v_cache, batch, layer.scaling, self.kernels)
            self.layer_hook.after_layer(index, chunks, self.cache)
            hidden, normed = ops.add_norm(layer.post_norm, hidden, layer.o(out))
            mlp = layer.down(ops.act_mul(layer.act, layer.gate_up(normed)))
            if index + 1 < layers.stop:
                hidden, normed = ops.add_norm(self.layers[index + 1].input_norm, hidden, mlp)
            else:
                hidden = hidden + mlp
        return hidden
