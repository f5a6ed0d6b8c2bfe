"""One stage of chunked pipeline-parallel prefill (the paper's CPP): a contiguous range of the model's
layers run over a request's prompt, chunk by chunk, with hidden states in and out.

A stage keeps its layers' KV of the chunks it ran in the engine's paged cache, so chunk ``c`` attends
to chunks ``< c``; the stage that runs the model's last layer samples the first token from the chunk
that ends the prompt. Stages run on the engine thread between steps (``Engine.run_stage``) and share
the block pool with the engine's own requests (``StageParts``: what a stage uses of the engine); ``release``
frees a request's blocks. The chunk and result types are the interface's (engine/interface.py).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any, NamedTuple

import torch

from halfmoon.core.block_format import BlockLayout, blank_block, decode_block
from halfmoon.core.detokenizer import IncrementalDetokenizer
from halfmoon.core.errors import InvalidRequestError, OutOfKVBlocksError, UnknownRequestError
from halfmoon.engine.attention import PagedKVCache
from halfmoon.engine.block_manager import BlockManager
from halfmoon.engine.interface import StageChunk, StageResult
from halfmoon.engine.layer_export import fill_layer
from halfmoon.engine.model_runner import ModelRunner
from halfmoon.engine.sampler import Sampler
from halfmoon.engine.sequence import ScheduledChunk, Sequence
from halfmoon.protocol.sampling import SamplingParams

TokenEnding = Callable[[IncrementalDetokenizer, SamplingParams, int, int, int, bool], tuple[str, str | None]]
"""``LLMEngine.token_ending``: a new output token's text, and why the output ends with it."""


class StageParts(NamedTuple):
    """What running stages takes of the engine they share: its model, cache and blocks, and its rules
    for a request's seed and for where an output ends."""

    layout: BlockLayout
    hidden_size: int
    vocab_size: int
    max_model_len: int
    tokenizer: Any
    blocks: BlockManager
    cache: PagedKVCache
    runner: ModelRunner
    sampler: Sampler
    token_ending: TokenEnding
    request_seed: Callable[[], int]


class PipelineStages:
    """The requests this engine runs a stage of. Contract: chunks of a request come in order, from
    position 0; a request's blocks stay until ``release``."""

    def __init__(self, parts: StageParts) -> None:
        self.parts = parts
        self._seqs: dict[str, Sequence] = {}

    def run(self, chunk: StageChunk) -> StageResult:
        parts = self.parts
        seq = self._sequence(chunk)
        tokens, end = list(chunk.token_ids), chunk.start + len(chunk.token_ids)
        num_layers = parts.layout.num_layers
        if not tokens or end > chunk.prompt_len or not 0 <= chunk.layers.start < chunk.layers.stop <= num_layers:
            raise InvalidRequestError(f"bad stage chunk: {len(tokens)} tokens at {chunk.start} of "
                                      f"{chunk.prompt_len}, layers {chunk.layers} of {num_layers}")
        if (chunk.hidden is None) != (chunk.layers.start == 0) or (
                chunk.hidden is not None and tuple(chunk.hidden.shape) != (len(tokens), parts.hidden_size)):
            raise InvalidRequestError("a stage takes hidden states exactly when it does not start at layer 0, "
                                      f"[{len(tokens)}, {parts.hidden_size}] of them")
        bad = next((t for t in tokens if not 0 <= t < parts.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {parts.vocab_size})")
        if not parts.blocks.can_grow(seq, end):
            raise OutOfKVBlocksError(f"no free KV blocks for {chunk.request_id}'s chunk at {chunk.start}")
        parts.blocks.allocate_slots(seq, end)
        seq.token_ids.extend(tokens)
        samples = chunk.layers.stop == num_layers and end == chunk.prompt_len
        out = parts.runner.forward_stage(ScheduledChunk(seq, chunk.start, len(tokens)), chunk.layers, chunk.hidden,
                                         logits=samples)
        seq.num_computed_tokens = end
        if not samples:
            return StageResult(None if chunk.layers.stop == num_layers else out)
        sampled = parts.sampler(out, [seq])
        token, logprob = sampled.token_ids[0], sampled.logprobs[0]
        detokenizer = IncrementalDetokenizer(parts.tokenizer, chunk.params.stop)
        text, reason = parts.token_ending(detokenizer, chunk.params, token, 1, end + 1, True)
        return StageResult(None, token, logprob, text, reason)

    def _sequence(self, chunk: StageChunk) -> Sequence:
        seq = self._seqs.get(chunk.request_id)
        if seq is None:
            parts = self.parts
            size = parts.blocks.block_size
            if chunk.start != len(chunk.prefix_token_ids) or chunk.start != len(chunk.prefix_blocks) * size:
                raise UnknownRequestError(f"{chunk.request_id}: a stage's first chunk starts at 0 or after whole "
                                          f"prefix blocks with their tokens, not at {chunk.start}")
            if chunk.prompt_len + chunk.params.max_tokens > parts.max_model_len:
                raise InvalidRequestError(f"prompt ({chunk.prompt_len} tokens) plus max_tokens exceeds the "
                                          f"model's context length of {parts.max_model_len} tokens")
            seq = Sequence(chunk.request_id, list(chunk.prefix_token_ids), chunk.params, 0, seed=parts.request_seed(),
                           num_prompt_tokens=chunk.prompt_len)
            if chunk.prefix_blocks:
                if not parts.blocks.can_grow(seq, chunk.start):
                    raise OutOfKVBlocksError(f"no free KV blocks for {chunk.request_id}'s reused prefix")
                kv = torch.cat([decode_block(parts.layout, block) for block in chunk.prefix_blocks], dim=2)
                parts.blocks.allocate_slots(seq, chunk.start)
                parts.cache.load_blocks(seq.block_table, kv[chunk.layers.start:chunk.layers.stop], chunk.layers.start)
                seq.num_computed_tokens = seq.num_cached_tokens = chunk.start
            self._seqs[chunk.request_id] = seq
        elif chunk.start != seq.num_tokens:
            raise InvalidRequestError(f"{chunk.request_id}: chunk at {chunk.start}, expected {seq.num_tokens}")
        return seq

    def payloads(self, request_id: str, layers: range) -> list[bytearray]:
        """Pool-format payloads of every block of the request's computed tokens with layers ``layers``
        filled (the rest zero, unsealed): the stage's share of each block."""
        seq = self._seqs.get(request_id)
        if seq is None:
            raise UnknownRequestError(request_id)
        parts, tokens = self.parts, seq.num_computed_tokens
        size = parts.blocks.block_size
        out = [blank_block(parts.layout, min(size, tokens - i * size)) for i in range(-(-tokens // size))]
        for layer in layers:
            fill_layer(parts.layout, parts.cache, layer, seq.block_table, 0, tokens, out)
        return out

    def release(self, request_id: str) -> bool:
        """Free the request's blocks; False when this engine holds none of it."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.parts.blocks.free(seq)
        return True

    def held(self) -> Seq[str]:
        return tuple(self._seqs)
