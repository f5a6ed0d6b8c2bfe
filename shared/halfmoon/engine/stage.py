"""One stage of chunked pipeline-parallel prefill (the paper's CPP): a contiguous range of the model's
layers run over a request's prompt, chunk by chunk, with hidden states in and out.

A stage keeps its layers' KV of the chunks it ran in the engine's paged cache, so chunk ``c`` attends
to chunks ``< c``; the stage that runs the model's last layer samples the first token from the chunk
that ends the prompt. Stages run on the engine thread between steps (``AsyncEngine.run_stage``) and
share the block pool with the engine's own requests; ``release`` frees a request's blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, NamedTuple

import torch
from halfmoon.core.block_format import blank_block, decode_block
from halfmoon.core.detokenizer import IncrementalDetokenizer
from halfmoon.core.errors import InvalidRequestError, OutOfKVBlocksError, UnknownRequestError
from halfmoon.engine.layer_export import fill_layer
from halfmoon.engine.scheduler import ScheduledChunk
from halfmoon.engine.sequence import Sequence
from halfmoon.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from halfmoon.engine.engine import LLMEngine


class StageChunk(NamedTuple):
    """Run layers ``layers`` over tokens ``[start, start + len(token_ids))`` of request ``request_id``,
    whose prompt has ``prompt_len`` tokens. ``hidden`` (``[tokens, hidden_size]``) is the input of
    ``layers.start``; None when the stage starts at the embeddings (``layers.start == 0``).

    A request's first chunk may start after a reused prefix: ``prefix_token_ids`` (``start`` of them) and
    ``prefix_blocks``, pool payloads of those tokens (whole blocks, every layer; the stage loads its own)."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    layers: range
    hidden: torch.Tensor | None
    prompt_len: int
    params: SamplingParams
    prefix_token_ids: tuple[int, ...] = ()
    prefix_blocks: Seq[bytes | memoryview] = ()


class StageResult(NamedTuple):
    """The stage's output: ``hidden`` for the next stage, or (the model's last layer, the prompt's last
    chunk) the first output token, its logprob, its text and why the output ends with it, if it does
    (``prefill_done`` when it goes on in decode)."""

    hidden: torch.Tensor | None
    token_id: int | None = None
    logprob: float | None = None
    text: str = ""
    finish_reason: str | None = None


def split_layers(num_layers: int, stages: int) -> tuple[int, ...]:
    """Boundaries of ``stages`` contiguous layer ranges as even as can be: stage ``s`` runs
    ``[bounds[s], bounds[s + 1])``."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    return tuple(math.floor(s * num_layers / stages) for s in range(stages + 1))


def hidden_bytes(hidden: torch.Tensor) -> bytes:
    """A stage's hidden states as raw bytes in the model's dtype (exact: the next stage sees the same values)."""
    return hidden.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def hidden_tensor(data: bytes, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`hidden_bytes`; ``tokens`` rows."""
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    if tokens < 1 or flat.numel() % tokens:
        raise InvalidRequestError(f"hidden states of {len(data)} bytes do not split into {tokens} rows")
    return flat.view(tokens, -1)


class PipelineStages:
    """The requests this engine runs a stage of. Contract: chunks of a request come in order, from
    position 0; a request's blocks stay until ``release``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._seqs: dict[str, Sequence] = {}

    def run(self, chunk: StageChunk) -> StageResult:
        engine = self.engine
        seq = self._sequence(chunk)
        tokens, end = list(chunk.token_ids), chunk.start + len(chunk.token_ids)
        num_layers = engine.kv_spec.num_layers
        if not tokens or end > chunk.prompt_len or not 0 <= chunk.layers.start < chunk.layers.stop <= num_layers:
            raise InvalidRequestError(f"bad stage chunk: {len(tokens)} tokens at {chunk.start} of "
                                      f"{chunk.prompt_len}, layers {chunk.layers} of {num_layers}")
        if (chunk.hidden is None) != (chunk.layers.start == 0) or (
                chunk.hidden is not None and tuple(chunk.hidden.shape) != (len(tokens), engine.hidden_size)):
            raise InvalidRequestError("a stage takes hidden states exactly when it does not start at layer 0, "
                                      f"[{len(tokens)}, {engine.hidden_size}] of them")
        bad = next((t for t in tokens if not 0 <= t < engine.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {engine.vocab_size})")
        if not engine.blocks.can_grow(seq, end):
            raise OutOfKVBlocksError(f"no free KV blocks for {chunk.request_id}'s chunk at {chunk.start}")
        engine.blocks.allocate_slots(seq, end)
        seq.token_ids.extend(tokens)
        samples = chunk.layers.stop == num_layers and end == chunk.prompt_len
        out = engine.runner.forward_stage(ScheduledChunk(seq, chunk.start, len(tokens)), chunk.layers, chunk.hidden,
                                          logits=samples)
        seq.num_computed_tokens = end
        if not samples:
            return StageResult(None if chunk.layers.stop == num_layers else out)
        sampled = engine.sampler(out, [seq])
        token, logprob = sampled.token_ids[0], sampled.logprobs[0]
        detokenizer = IncrementalDetokenizer(engine.tokenizer, chunk.params.stop)
        text, reason = engine.token_ending(detokenizer, chunk.params, token, 1, end + 1, prefill_only=True)
        return StageResult(None, token, logprob, text, reason)

    def _sequence(self, chunk: StageChunk) -> Sequence:
        seq = self._seqs.get(chunk.request_id)
        if seq is None:
            engine, size = self.engine, self.engine.config.block_size
            if chunk.start != len(chunk.prefix_token_ids) or chunk.start != len(chunk.prefix_blocks) * size:
                raise UnknownRequestError(f"{chunk.request_id}: a stage's first chunk starts at 0 or after whole "
                                          f"prefix blocks with their tokens, not at {chunk.start}")
            if chunk.prompt_len + chunk.params.max_tokens > engine.max_model_len:
                raise InvalidRequestError(f"prompt ({chunk.prompt_len} tokens) plus max_tokens exceeds the "
                                          f"model's context length of {engine.max_model_len} tokens")
            seq = Sequence(chunk.request_id, list(chunk.prefix_token_ids), chunk.params, 0, seed=engine.request_seed())
            if chunk.prefix_blocks:
                if not engine.blocks.can_grow(seq, chunk.start):
                    raise OutOfKVBlocksError(f"no free KV blocks for {chunk.request_id}'s reused prefix")
                kv = torch.cat([decode_block(engine.layout, block) for block in chunk.prefix_blocks], dim=2)
                engine.blocks.allocate_slots(seq, chunk.start)
                engine.cache.load_blocks(seq.block_table, kv[chunk.layers.start:chunk.layers.stop], chunk.layers.start)
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
        engine, tokens = self.engine, seq.num_computed_tokens
        size = engine.config.block_size
        out = [blank_block(engine.layout, min(size, tokens - i * size)) for i in range(-(-tokens // size))]
        for layer in layers:
            fill_layer(engine.layout, engine.cache, layer, seq.block_table, 0, tokens, out)
        return out

    def release(self, request_id: str) -> bool:
        """Free the request's blocks; False when this engine holds none of it."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.engine.blocks.free(seq)
        return True

    def held(self) -> Seq[str]:
        return tuple(self._seqs)
