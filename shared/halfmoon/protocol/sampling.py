"""Per-request sampling parameters, shared by the wire protocol and the engine."""

from __future__ import annotations

import msgspec

# Bounds that keep every field a machine integer (the engine puts top_k in int64 tensors; seeds are
# int64 as in OpenAI's API); a larger top_k than the vocabulary means "off" anyway.
MAX_TOP_K = (1 << 31) - 1
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick tokens for one request.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. ``seed`` makes sampling reproducible per request. ``stop`` strings end the
    output before the string; ``stop_token_ids`` and EOS end it after the token (the token
    itself is not returned as text). ``logprobs`` asks for the log-probability of each
    chosen token under the model's unmodified distribution.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be 0 (off) or positive and at most {MAX_TOP_K}, got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
