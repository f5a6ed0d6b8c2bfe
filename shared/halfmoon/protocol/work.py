"""Work hand-offs: gateway -> prefill, prefill -> decode, and cancellation."""

from __future__ import annotations

import math
from enum import StrEnum

import msgspec

from halfmoon.core.tiers import Tier
from halfmoon.protocol.base import Message
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.subjects import check_token


class PrefillRequest(Message, frozen=True, kw_only=True, tag="prefill"):
    """Compute the prompt's KV and first token, then hand off to ``decode_instance``.

    Tokens go to ``Subjects.stream(gateway, request_id)`` as TokenEvents numbered from index 0, where
    ``gateway`` is the issuer the submit's subject names (``Subjects.prefill_submit``), never a field: a
    gateway's NATS user may submit only naming itself, so forged requests stream only into that
    gateway's own streams, whatever request id they name. ``deadline`` is
    absolute unix time; work past it may be dropped with an ErrorEvent(TIMEOUT). The W3C
    trace context travels in the NATS headers, not here.

    A migrated request continues: ``output_token_ids`` are the tokens already streamed
    (their KV is taken from the pool where it is there, recomputed where not), the next token
    is index ``len(output_token_ids)``, and every event carries ``attempt``.

    ``pipeline`` (CPP): the other prefill instances, in stage order, that run the later layers of this
    prompt with this one (the head, stage 0); empty: this instance prefills alone.

    ``step_target_s`` (an aggregated instance's; 0: none): while other sequences decode there, the prompt's
    chunks keep the steps they share within this many seconds (``Engine.generate``). The conductor sets it
    where the prompt, computed at full speed, would hold those sequences past the TBT SLO.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    decode_instance: str
    deadline: float
    tenant_salt: str | None = None
    tenant: str = ""  # whose pool quota the request's blocks count against ("": none)
    output_token_ids: tuple[int, ...] = ()
    attempt: int = 0
    pipeline: tuple[str, ...] = ()
    step_target_s: float = 0.0

    def __post_init__(self) -> None:
        check_token(self.request_id, "request_id")
        check_token(self.decode_instance, "decode_instance")
        if not (math.isfinite(self.step_target_s) and self.step_target_s >= 0):
            raise ValueError(f"step_target_s must be a finite number >= 0, got {self.step_target_s}")
        for stage in self.pipeline:
            check_token(stage, "pipeline stage")
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if self.attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {self.attempt}")


class BlockLocation(msgspec.Struct, frozen=True, kw_only=True):
    """Where a reader finds one KV block: a :class:`~halfmoon.core.locations.Replica` resolved to the
    transfer node's ``address`` (``host:port``) and DRAM ``segment``, with the block's key.

    ``key`` is the chained content key when the block is a cached (full) block, or the one-off
    key of scratch data such as the partial last block of a hand-off.
    """

    address: str
    offset: int
    size: int
    segment: str = ""
    key: bytes | None = None
    tier: Tier = Tier.DRAM  # ``offset`` is valid in ``segment`` for DRAM only
    capability: bytes = b""  # what the holder may do to this block on ``address``, until when (PROTOCOL.md)

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("address must not be empty")
        if self.offset < 0 or self.size < 1:
            raise ValueError(f"need offset >= 0 and size >= 1, got offset={self.offset} size={self.size}")


class KVLocation(msgspec.Struct, frozen=True, kw_only=True):
    """The KV of a request's first ``num_tokens`` tokens: full blocks plus the partial tail.

    Invariant: ``len(blocks) == num_tokens // block_size`` and ``partial`` is present
    exactly when ``num_tokens % block_size != 0``.
    """

    block_size: int
    num_tokens: int
    blocks: tuple[BlockLocation, ...]
    partial: BlockLocation | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_tokens < 1:
            raise ValueError(f"block_size and num_tokens must be >= 1, got {self.block_size}, {self.num_tokens}")
        full, rest = divmod(self.num_tokens, self.block_size)
        if len(self.blocks) != full:
            raise ValueError(f"{self.num_tokens} tokens need {full} full blocks, got {len(self.blocks)}")
        if (rest != 0) != (self.partial is not None):
            raise ValueError(f"partial block must be present iff num_tokens % block_size != 0 ({rest})")

    @property
    def partial_tokens(self) -> int:
        return self.num_tokens % self.block_size


class KVProgress(Message, frozen=True, kw_only=True, tag="kv_progress"):
    """Prefill -> the decode instance it will hand ``request_id`` to, while prefill still computes:
    layers ``[0, layers_done)`` of the request's blocks ``indexes`` (of ``num_tokens`` tokens in
    ``block_size`` blocks; the last may be partial) are written at ``blocks``' DRAM extents, sealed
    layer by layer, not yet committed. Sent once per batch of layers, in order; decode reads each
    batch as it comes (transports that address the segment directly) and verifies every layer's
    MAC. The DecodeRequest that follows says where every block is; what decode has not read by then
    it reads whole.
    """

    request_id: str
    block_size: int
    num_tokens: int
    indexes: tuple[int, ...]
    blocks: tuple[BlockLocation, ...]
    layers_done: int

    def __post_init__(self) -> None:
        check_token(self.request_id, "request_id")
        count = -(-self.num_tokens // self.block_size) if self.block_size > 0 else 0
        if self.layers_done < 1 or len(self.indexes) != len(self.blocks) or count < 1:
            raise ValueError("need layers_done >= 1, block_size and num_tokens >= 1, one location per index")
        if any(not 0 <= i < count for i in self.indexes) or any(b.key is None for b in self.blocks):
            raise ValueError(f"indexes must be inside 0..{count - 1} and every block keyed")

    def tokens(self, index: int) -> int:
        """Tokens in block ``index``."""
        return min(self.block_size, self.num_tokens - index * self.block_size)


class DecodeRequest(Message, frozen=True, kw_only=True, tag="decode"):
    """Continue a prefilled request: pull its KV from ``kv``, then generate from the first token.

    ``first_token_id`` (and ``first_logprob`` when logprobs were asked for) is the token
    prefill sampled after ``output_token_ids`` (empty unless the request migrated); prefill
    has already streamed it as index ``len(output_token_ids)``, so decode numbers its
    TokenEvents from the index after it. ``kv`` covers the prompt and ``output_token_ids``;
    ``None`` when prefill could not place it anywhere (no live transfer node): decode
    recomputes it. ``layers_announced``: the layers prefill told decode about in KVProgress
    messages before this request; decode waits a moment for those reads to finish before it
    reads whole what it still lacks.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_token_id: int
    sampling: SamplingParams
    kv: KVLocation | None
    gateway: str  # the submit's issuer: decode streams to Subjects.stream(gateway, request_id)
    prefill_instance: str
    deadline: float
    first_logprob: float | None = None
    cached_tokens: int = 0
    output_token_ids: tuple[int, ...] = ()
    attempt: int = 0
    tenant_salt: str | None = None
    layers_announced: int = 0

    def __post_init__(self) -> None:
        check_token(self.request_id, "request_id")
        check_token(self.gateway, "gateway")
        if self.layers_announced < 0:
            raise ValueError(f"layers_announced must be >= 0, got {self.layers_announced}")
        context = len(self.prompt_token_ids) + len(self.output_token_ids)
        if self.kv is not None and self.kv.num_tokens != context:
            raise ValueError(f"kv covers {self.kv.num_tokens} tokens, prompt and output have {context}")
        if not 0 <= self.cached_tokens <= len(self.prompt_token_ids):
            raise ValueError(f"cached_tokens {self.cached_tokens} out of range")
        if self.attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {self.attempt}")


class CancelRequest(Message, frozen=True, kw_only=True, tag="cancel"):
    """The requester gave up on ``request_id`` (client gone, deadline passed): free its work.

    ``attempt`` set: only that attempt (the request migrated away from it); None: every attempt.
    """

    request_id: str
    reason: str = ""
    attempt: int | None = None

    def __post_init__(self) -> None:
        check_token(self.request_id, "request_id")


class WorkOutcome(StrEnum):
    COMPLETED = "completed"  # this instance's part is done (prefill: the first token; decode: the last)
    FAILED = "failed"  # an error ended the request here
    CANCELLED = "cancelled"  # the requester cancelled it, or the instance shut down holding it


class WorkDone(Message, frozen=True, kw_only=True, tag="work_done"):
    """``instance_id`` is through with ``request_id`` (attempt ``attempt``): its work no longer loads it.

    Published once per request and instance when its engine work ends, and once more by a prefill
    instance whose hand-off then fails (nothing downstream will run). The conductors clear their
    ledgers of placed work with it.
    """

    request_id: str
    instance_id: str
    outcome: WorkOutcome
    attempt: int = 0

    def __post_init__(self) -> None:
        check_token(self.request_id, "request_id")
