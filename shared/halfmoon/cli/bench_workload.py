"""What `halfmoon bench` sends: a fixed-shape workload or a Mooncake trace scaled down. Pure code.

Prompts are lists of token ids (the OpenAI completions API takes them as ``prompt``), so their length is
exact on any model and equal trace blocks are equal tokens: a block with hash id ``h`` is always the same
``block_tokens`` ids (seeded by ``h``), so a server's prefix cache really can reuse what the trace shares.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import NamedTuple

from halfmoon.sim.trace import TraceRequest

TRACE_BLOCK_TOKENS = 512  # the Mooncake trace's hash_ids each stand for this many prompt tokens


class TokenRange(NamedTuple):
    """Prompt token ids are drawn from [low, high): valid ids on every model it is used with."""

    low: int = 100
    high: int = 2000

    def check(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"token range must satisfy 0 <= low < high, got [{self.low}, {self.high})")


DEFAULT_TOKENS = TokenRange()


class BenchRequest(NamedTuple):
    prompt: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # seconds after the run starts; 0 for a fixed-concurrency run
    hash_ids: tuple[int, ...] = ()


def fixed_requests(count: int, input_tokens: int, output_tokens: int, tokens: TokenRange = DEFAULT_TOKENS,
                   seed: int = 0) -> list[BenchRequest]:
    """``count`` requests of independent random prompts (nothing shared between them)."""
    if count < 0 or input_tokens < 1 or output_tokens < 1:
        raise ValueError("need count >= 0, input tokens >= 1 and output tokens >= 1")
    tokens.check()
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(tokens.low, tokens.high) for _ in range(input_tokens)], output_tokens)
            for _ in range(count)]


class TraceScaling(NamedTuple):
    """How a trace shrinks to fit a small model: each 512-token block becomes ``block_tokens`` tokens,
    output lengths are multiplied by ``output_scale`` and capped at ``max_output_tokens`` (0: no cap),
    arrival times are divided by ``speedup``."""

    block_tokens: int = 16
    output_scale: float = 1.0
    max_output_tokens: int = 0
    speedup: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if self.block_tokens < 1 or self.output_scale <= 0 or self.max_output_tokens < 0 or self.speedup <= 0:
            raise ValueError("need block tokens >= 1, output scale > 0, max output tokens >= 0 and speedup > 0")


class BlockTokens:
    """The token ids standing for one trace block: a deterministic function of its hash id."""

    def __init__(self, size: int, tokens: TokenRange, seed: int) -> None:
        self.size, self.tokens, self.seed = size, tokens, seed
        self._memo: dict[int, list[int]] = {}

    def __call__(self, hash_id: int) -> list[int]:
        block = self._memo.get(hash_id)
        if block is None:
            rng = random.Random(f"{self.seed}:{hash_id}")
            block = self._memo[hash_id] = [rng.randrange(self.tokens.low, self.tokens.high) for _ in range(self.size)]
        return block


def trace_requests(trace: Sequence[TraceRequest], scaling: TraceScaling,
                   tokens: TokenRange = DEFAULT_TOKENS) -> list[BenchRequest]:
    """The trace, scaled: a prompt is its blocks' tokens cut to ``input_length`` scaled the same way;
    arrivals are relative to the first request."""
    scaling.check()
    tokens.check()
    blocks = BlockTokens(scaling.block_tokens, tokens, scaling.seed)
    start = trace[0].arrival_s if trace else 0.0
    out = []
    for req in trace:
        length = max(1, math.ceil(req.input_length * scaling.block_tokens / TRACE_BLOCK_TOKENS))
        prompt = [t for h in req.hash_ids for t in blocks(h)][:length]
        if len(prompt) < length:
            raise ValueError(f"trace request at {req.arrival_s}s has {len(req.hash_ids)} blocks for "
                             f"{req.input_length} tokens (need ceil(input_length / {TRACE_BLOCK_TOKENS}))")
        max_tokens = max(1, round(req.output_length * scaling.output_scale))
        if scaling.max_output_tokens:
            max_tokens = min(max_tokens, scaling.max_output_tokens)
        out.append(BenchRequest(prompt, max_tokens, (req.arrival_s - start) / scaling.speedup, req.hash_ids))
    return out
