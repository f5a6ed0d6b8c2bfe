"""Per-request stream events, published by prefill/decode, consumed by the gateway."""

from __future__ import annotations

from typing import Literal

import msgspec
from halfmoon.protocol.base import ErrorCode, Message

FinishReason = Literal["stop", "length"]


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Token counts of a finished request; ``cached_tokens`` were reused, not recomputed."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        if min(self.prompt_tokens, self.completion_tokens, self.cached_tokens) < 0:
            raise ValueError("usage counts must be >= 0")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"cached_tokens {self.cached_tokens} > prompt_tokens {self.prompt_tokens}")


class TokenEvent(Message, frozen=True, kw_only=True, tag="tokens"):
    """New output tokens of one request.

    ``index`` is the position of ``token_ids[0]`` in the output, so a consumer can order
    events from several publishers (prefill sends index 0, decode the rest). Token ids are
    final: stop strings were already applied by the engine, the gateway detokenises. The
    last event has ``finish_reason`` and ``usage``. ``logprobs`` (when asked for) has one
    entry per token id.
    """

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    instance_id: str = ""
    logprobs: tuple[float, ...] | None = None
    text: str | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"index must be >= 0, got {self.index}")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.token_ids)} tokens")
        if (self.finish_reason is None) != (self.usage is None):
            raise ValueError("finish_reason and usage come together, on the last event only")


class ErrorEvent(Message, frozen=True, kw_only=True, tag="stream_error"):
    """The request failed; nothing more will come for it."""

    request_id: str
    code: ErrorCode
    message: str
    instance_id: str = ""


StreamEvent = TokenEvent | ErrorEvent
