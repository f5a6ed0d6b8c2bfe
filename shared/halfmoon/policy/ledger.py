"""The Conductor's per-request ledger of placed work: what each instance is expected to be doing.

Every placement adds one entry per stage (prefill, then decode) naming the request, the instance, the
predicted work and a deadline. An entry leaves the ledger however its request ends:

- ``done``: the instance finished its part (the next stage is then due) or failed / was cancelled (the
  whole request is over);
- ``end``: the requester gave up (cancelled, disconnected);
- ``instance_down``: the instance is gone;
- ``reconcile``: the instance's heartbeat holds fewer requests than the ledger says it should, so the
  oldest entries it should have had long enough (never taken, or finished unheard) are dropped;
- ``expire``: no outcome ever arrived by the entry's deadline.

Pure bookkeeping: no I/O and no clock (``now`` is passed in, any monotonic seconds). The live
conductor and the simulator both keep one.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


class Cleared(StrEnum):
    """How entries left the ledger (a metric label)."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DOWN = "instance_down"
    RECONCILED = "reconciled"
    EXPIRED = "expired"
    REPLACED = "replaced"


class Stage(NamedTuple):
    """One instance's part of a placement. Stages of a lower ``order`` run first; an entry is *due*
    (expected on its instance, so heartbeats may reconcile it) once every earlier stage is done."""

    instance_id: str
    order: int
    expires_at: float
    work_s: float = 0.0  # predicted seconds of work on that instance
    tokens: int = 0
    decode_tokens: int = 0  # a decode stage's: the request's max_tokens
    paced: bool = False  # a prefill stage whose prompt was admitted paced (SloAwareDecode.paced)


def is_decoder(max_tokens: int) -> bool:
    """Whether a request for ``max_tokens`` has gaps between tokens for prompt work sharing its steps to
    lengthen: a request for one token has none."""
    return max_tokens > 1


@dataclass(frozen=True, slots=True)
class Outstanding:
    """What the ledger holds for one instance: ``count`` entries, of ``requests`` requests (an instance
    serving both stages of a request holds two entries of it until its prefill is done); ``decoders`` of
    them decode stages whose ``max_tokens`` leaves a gap between tokens (2 or more), ``decode_tokens`` theirs
    in all. A request for one token has no gap that prompt work could lengthen. ``paced_work_s``: of
    ``work_s``, that of prompts admitted paced."""

    count: int = 0
    work_s: float = 0.0
    tokens: int = 0
    requests: int = 0
    decode_tokens: int = 0
    decoders: int = 0
    paced_work_s: float = 0.0

    @property
    def mean_decode_tokens(self) -> float:
        """The mean ``max_tokens`` of the decode stages that name one (0: none does)."""
        return self.decode_tokens / self.decoders if self.decoders else 0.0


@dataclass(slots=True)
class _Entry:
    request_id: Hashable
    stage: Stage
    due_since: float | None = None

    @property
    def key(self) -> tuple[Hashable, int]:
        return self.request_id, self.stage.order


class WorkLedger:
    """Entries by request and by instance. ``grace_s``: how long a due entry may be missing from its
    instance's reported load before a heartbeat may drop it (the time for the work to arrive there)."""

    def __init__(self, grace_s: float = 2.0) -> None:
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.grace_s = grace_s
        self._requests: dict[Hashable, list[_Entry]] = {}
        self._instances: dict[str, dict[tuple[Hashable, int], _Entry]] = {}  # by (request id, stage order)
        self._totals: dict[str, Outstanding] = {}  # kept as entries come and go: read once per placement
        self.cleared: dict[Cleared, int] = dict.fromkeys(Cleared, 0)  # entries cleared so far, by how

    def place(self, request_id: Hashable, stages: Sequence[Stage], now: float) -> None:
        """Record a placement; one already held for ``request_id`` (an earlier attempt) is replaced."""
        if not stages:
            raise ValueError("a placement has at least one stage")
        self._drop(self._requests.get(request_id, ()), Cleared.REPLACED, now)
        entries = [_Entry(request_id, stage) for stage in sorted(stages, key=lambda s: s.order)]
        self._requests[request_id] = entries
        for i, entry in enumerate(entries):
            self._instances.setdefault(entry.stage.instance_id, {})[entry.key] = entry
            first_here = all(e.stage.instance_id != entry.stage.instance_id for e in entries[:i])
            self._count(entry.stage, 1, first_here)
        self._advance(request_id, now)

    def done(self, request_id: Hashable, instance_id: str, how: Cleared, now: float) -> int:
        """``instance_id`` is through with its current part of ``request_id``: ``COMPLETED`` (its earliest
        stage there leaves; later stages become due; an instance doing both parts reports each), or the
        request ended there otherwise (failed, cancelled: nothing later will run). An instance that is not
        part of the request's current placement speaks of an older attempt and is ignored. Returns the
        entries cleared."""
        entries = self._requests.get(request_id, [])
        mine = [e for e in entries if e.stage.instance_id == instance_id]
        if not mine:
            return 0
        if how is not Cleared.COMPLETED:
            return self._drop(entries, how, now)
        first = min(e.stage.order for e in mine)
        return self._drop([e for e in mine if e.stage.order == first], how, now)

    def end(self, request_id: Hashable, now: float, how: Cleared = Cleared.CANCELLED) -> int:
        """The request is over everywhere (its requester gave up)."""
        return self._drop(self._requests.get(request_id, ()), how, now)

    def instance_down(self, instance_id: str, now: float) -> int:
        return self._drop(list(self._instances.get(instance_id, {}).values()), Cleared.DOWN, now)

    def expire(self, now: float) -> int:
        """Drop every entry past its deadline."""
        late = [e for entries in self._requests.values() for e in entries if e.stage.expires_at <= now]
        return self._drop(late, Cleared.EXPIRED, now)

    def reconcile(self, instance_id: str, held: int, now: float) -> int:
        """The instance reports holding ``held`` requests. Entries due there for longer than the grace
        should be among them: any beyond ``held`` are stale, and the oldest go first (the instance
        serves in arrival order, so what it finished unheard or never got is the oldest)."""
        settled = sorted((e for e in self._instances.get(instance_id, {}).values()
                          if e.due_since is not None and e.due_since <= now - self.grace_s),
                         key=lambda e: e.due_since or 0.0)
        return self._drop(settled[: max(0, len(settled) - held)], Cleared.RECONCILED, now)

    def outstanding(self, instance_id: str) -> Outstanding:
        return self._totals.get(instance_id, Outstanding())

    def stages(self, request_id: Hashable) -> tuple[Stage, ...]:
        return tuple(e.stage for e in self._requests.get(request_id, ()))

    def __len__(self) -> int:
        """Entries held."""
        return sum(len(entries) for entries in self._instances.values())

    def instances(self) -> list[str]:
        return sorted(self._instances)

    def _drop(self, entries: Iterable[_Entry], how: Cleared, now: float) -> int:
        gone = list(entries)
        touched: set[Hashable] = set()
        for entry in gone:
            rid, iid = entry.request_id, entry.stage.instance_id
            remaining = [e for e in self._requests.get(rid, ()) if e is not entry]
            if remaining:
                self._requests[rid] = remaining
            else:
                self._requests.pop(rid, None)
            on_instance = self._instances.get(iid, {})
            if on_instance.pop(entry.key, None) is not None:
                self._count(entry.stage, -1, all(e.stage.instance_id != iid for e in remaining))
            if not on_instance:
                self._instances.pop(iid, None)
            touched.add(rid)
        for rid in touched:
            self._advance(rid, now)
        self.cleared[how] += len(gone)
        return len(gone)

    def _count(self, stage: Stage, sign: int, request_too: bool) -> None:
        """``request_too``: the entry is its request's only one on the instance."""
        held = self._totals.get(stage.instance_id, Outstanding())
        gaps = is_decoder(stage.decode_tokens)
        count = held.count + sign
        if count == 0:  # exactly nothing: no rounding residue of the work sums
            self._totals.pop(stage.instance_id, None)
            return
        self._totals[stage.instance_id] = Outstanding(count, held.work_s + sign * stage.work_s,
                                                      held.tokens + sign * stage.tokens,
                                                      held.requests + (sign if request_too else 0),
                                                      held.decode_tokens + sign * stage.decode_tokens * gaps,
                                                      held.decoders + sign * gaps,
                                                      held.paced_work_s + sign * stage.work_s * stage.paced)

    def _advance(self, request_id: Hashable, now: float) -> None:
        """Mark the first outstanding stage of a request due (from ``now`` if it was not yet)."""
        entries = self._requests.get(request_id)
        if not entries:
            return
        first = entries[0].stage.order
        for entry in entries:
            if entry.stage.order == first and entry.due_since is None:
                entry.due_since = now

