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
    events from several publishers (prefill sends index 0, decode the rest) and drop
    repeats (a publisher re-sends recent events on a ResumeRequest). ``attempt`` numbers the
    placements of one request (0 first, one more per migration); a consumer drops events of
    any attempt but the current one, so a stalled instance that wakes up adds nothing. Token ids are
    final: stop strings were already applied by the engine, the gateway detokenises. The
    last event has ``finish_reason`` and ``usage``. ``logprobs`` (when asked for) has one
    entry per token id.
    """

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    instance_id: str = ""
    attempt: int = 0
    logprobs: tuple[float, ...] | None = None
    text: str | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None

    def __post_init__(self) -> None:
        if self.index < 0 or self.attempt < 0:
            raise ValueError(f"index and attempt must be >= 0, got {self.index}, {self.attempt}")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.token_ids)} tokens")
        if (self.finish_reason is None) != (self.usage is None):
            raise ValueError("finish_reason and usage come together, on the last event only")


class ErrorEvent(Message, frozen=True, kw_only=True, tag="stream_error"):
    """Attempt ``attempt`` of the request failed; nothing more will come from it."""

    request_id: str
    code: ErrorCode
    message: str
    instance_id: str = ""
    attempt: int = 0


class ResumeRequest(Message, frozen=True, kw_only=True, tag="resume"):
    """Re-send attempt ``attempt``'s stream from output index ``from_index`` on (events lost in a NATS outage).

    The instance answers Ack when it holds the attempt (running, or finished within its replay
    window) and re-publishes its buffered events that reach ``from_index``; ErrorReply when it
    does not, or no longer has events that far back (then the requester migrates the request).
    """

    request_id: str
    attempt: int
    from_index: int

    def __post_init__(self) -> None:
        if self.attempt < 0 or self.from_index < 0:
            raise ValueError(f"attempt and from_index must be >= 0, got {self.attempt}, {self.from_index}")


StreamEvent = TokenEvent | ErrorEvent
