"""Conductor request/reply: where should a request run, or why not at all."""

from __future__ import annotations

import math
from enum import StrEnum

from halfmoon.protocol.base import Message
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.subjects import check_token


class ScheduleRequest(Message, frozen=True, kw_only=True, tag="schedule"):
    """Ask the conductor for a prefill + decode pair.

    The prompt travels as its length plus, when the sender has them, its token ids and/or
    its chained block keys (cache-aware policies use either). ``deadline`` is absolute unix
    time in seconds by which the first token is wanted. ``tenant_salt`` keeps tenants'
    cache blocks apart. ``exclude`` names instances the sender saw fail this request (a
    migration): the conductor places elsewhere even before it notices they are gone. ``attempt``: 0 for
    the request's first placement; later ones continue a request admitted before (a migration, with the
    tokens streamed so far in the prompt), and are placed rather than rejected for predicted overload.
    ``waited_s``: how long the request has already waited for a placement (the gateway asks again while
    the conductor answers ``overloaded``); it counts against the TTFT SLO.
    """

    request_id: str
    model: str
    prompt_len: int
    sampling: SamplingParams
    deadline: float
    prompt_token_ids: tuple[int, ...] = ()
    block_keys: tuple[bytes, ...] = ()
    tenant_salt: str | None = None
    exclude: tuple[str, ...] = ()
    attempt: int = 0
    waited_s: float = 0.0

    def __post_init__(self) -> None:
        check_token(self.request_id, "request_id")
        if self.attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {self.attempt}")
        if not 0.0 <= self.waited_s < float("inf"):
            raise ValueError(f"waited_s must be a finite number >= 0, got {self.waited_s}")
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len must be at least 1, got {self.prompt_len}")
        if self.prompt_token_ids and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(f"prompt_len {self.prompt_len} != {len(self.prompt_token_ids)} prompt_token_ids")


class ScheduleAccepted(Message, frozen=True, kw_only=True, tag="accepted"):
    """The chosen pair; the requester submits a PrefillRequest to ``prefill_instance``. ``pipeline`` (CPP):
    the prefill instances that run the later layers with it, in stage order (the PrefillRequest's
    ``pipeline``); empty: ``prefill_instance`` prefills alone. The incarnations are the runs of the two
    instances the conductor last heard (empty: unknown), so the requester can tell an InstanceDown
    about an earlier run from one about the run it was placed on. ``step_target_s`` (0: none): the
    PrefillRequest's, the step time the prompt's chunks are paced to on an aggregated instance."""

    request_id: str
    prefill_instance: str
    decode_instance: str
    predicted_ttft_ms: float | None = None
    pipeline: tuple[str, ...] = ()
    predicted_tbt_ms: float | None = None  # the chosen decode instance's predicted time between tokens
    prefill_incarnation: str = ""
    decode_incarnation: str = ""
    step_target_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.step_target_s) and self.step_target_s >= 0):
            raise ValueError(f"step_target_s must be a finite number >= 0, got {self.step_target_s}")


class Placed(Message, frozen=True, kw_only=True, tag="placed"):
    """Conductor ``conductor`` placed ``request_id`` on this pair: the others enter it in their ledgers
    too. ``prefill_s``: the predicted prefill work; ``ttl_s``: how long after placement it may stay
    without news before it expires (prefill), ``decode_ttl_s`` the same for the decode part. ``pipeline``:
    the later stages of a pipelined prefill (each busy about as long as the head). ``max_tokens`` and
    ``reused_tokens`` (prompt tokens the prefill instance is expected to reuse from the cache) are what
    the planner forecasts output lengths and cache hits from. ``paced``: the prompt was admitted paced
    (``ScheduleAccepted.step_target_s``): its work shares the steps of the sequences decoding there only as
    far as its step target lets it."""

    conductor: str
    prefill_instance: str
    decode_instance: str
    request_id: str
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    max_tokens: int = 0
    reused_tokens: int = 0
    ttl_s: float = 60.0
    decode_ttl_s: float = 600.0
    pipeline: tuple[str, ...] = ()
    paced: bool = False

    def __post_init__(self) -> None:
        check_token(self.request_id, "request_id")


class RejectReason(StrEnum):
    NO_PREFILL_INSTANCE = "no_prefill_instance"
    NO_DECODE_INSTANCE = "no_decode_instance"
    OVERLOADED = "overloaded"
    DEADLINE = "deadline"


class Rejected(Message, frozen=True, kw_only=True, tag="rejection"):
    """Conductor ``conductor`` turned ``request_id`` away (its ScheduleRejected said ``reason``): demand no
    placement shows, for the planner's forecast. A requester retries under the same ``request_id``, so
    one request may be noted several times, and placed after."""

    conductor: str
    request_id: str
    reason: RejectReason
    prompt_tokens: int = 0
    max_tokens: int = 0

    def __post_init__(self) -> None:
        check_token(self.request_id, "request_id")


# Nobody of a role is live: an absence that supervision repairs in seconds, unlike overload, so a requester
# may wait for an instance within its deadline instead of failing at once.
ABSENT_ROLE = frozenset({RejectReason.NO_PREFILL_INSTANCE, RejectReason.NO_DECODE_INSTANCE})


class ReadinessRequest(Message, frozen=True, kw_only=True, tag="readiness"):
    """Could a schedule request be placed now? Sent on the schedule subject, so only a conductor that takes
    schedule requests (past its warm-up) answers."""


class Readiness(Message, frozen=True, kw_only=True, tag="readiness_reply"):
    """The answering conductor's live, non-draining instances by role; ``ready`` when a prefill and a decode
    instance, or an aggregated one, are among them (a placement would find a pair)."""

    conductor: str
    ready: bool
    prefill: int = 0
    decode: int = 0
    aggregated: int = 0


class ScheduleRejected(Message, frozen=True, kw_only=True, tag="rejected"):
    """Early rejection: nothing was started; try again after ``retry_after_s``. ``clears_in_s``: the
    conductor expects this request itself to be placeable after about this long, as the prompt work queued
    ahead of it drains and the pace of prompts lately passes (None: waiting would not let it in; a later
    request may still be placed)."""

    request_id: str
    reason: RejectReason
    message: str
    retry_after_s: float = 1.0
    clears_in_s: float | None = None

    def __post_init__(self) -> None:
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.clears_in_s is not None and not 0.0 <= self.clears_in_s < float("inf"):
            raise ValueError(f"clears_in_s must be a finite number >= 0, got {self.clears_in_s}")
