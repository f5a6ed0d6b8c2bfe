"""Admission under overload: none, early rejection, prediction-based early rejection.

Without early rejection a request is prefilled first and may be turned away only when it
reaches an overloaded decode pool, wasting its prefill. Early rejection moves that check
before the prefill, judging the decode pool as it is now; the prediction-based variant
judges it as it will be when this request's prefill finishes, counting only the work that
will still be running then, which avoids rejecting on load that is about to drain.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from halfmoon.policy.decode import DecodeChoice, SloAwareDecode
from halfmoon.policy.state import DecodeInstanceState

MIN_RETRY_AFTER_S = 1.0
# the gateway's default wait for an overload the conductor expects to clear: the default TTFT SLO, past which
# the conductor stops expecting it to
OVERLOAD_WAIT_S = 30.0
# a request waiting out an overload asks again after the expected wait, within these bounds: the conductor's
# view changes with every heartbeat and finished request, a second at most apart
OVERLOAD_POLL_S = (0.1, 1.0)


class AdmissionDecision(NamedTuple):
    """``reason`` is ``"ok"`` when accepted; ``retry_after_s`` is a hint for HTTP 429 Retry-After.
    ``decode``: accepted, the instance chosen (None: choose at hand-off); rejected, the one that came
    nearest (its predicted TBT is what the rejection says), or None when the request fits none.
    ``clears_in_s``: rejected, how long until the prompt work queued ahead drains, and the pace of prompts
    lately passes, enough to let this request in (``SloAwareDecode.clears_in``); None: waiting would not."""

    accepted: bool
    reason: str
    retry_after_s: float
    decode: DecodeChoice | None
    clears_in_s: float | None = None


def overload_pause(clears_in_s: float | None, waited_s: float, wait_limit_s: float) -> float | None:
    """Seconds until a request turned away as overloaded asks again, or None: answer it with a 429 now.

    ``clears_in_s`` is the conductor's expected wait (``AdmissionDecision``; None: waiting would not help),
    ``waited_s`` how long the request has waited so far, ``wait_limit_s`` the most it may wait in all (the
    gateway's ``overload_wait_s``, cut to its deadline). It asks again while the overload is expected to clear
    within that limit. The gateway and the simulator both wait by this rule."""
    if clears_in_s is None:
        return None
    pause = min(max(clears_in_s, OVERLOAD_POLL_S[0]), OVERLOAD_POLL_S[1])
    return pause if waited_s + max(clears_in_s, pause) < wait_limit_s else None


def retry_after(instances: Sequence[DecodeInstanceState], after: float) -> float:
    """Seconds until some decode work is expected to end after ``after`` (at least one second)."""
    ends = [e for e in (s.earliest_end_after(after) for s in instances) if e is not None]
    return max(MIN_RETRY_AFTER_S, min(ends) - after) if ends else MIN_RETRY_AFTER_S


class AdmissionPolicy(ABC):
    """Decides before prefill whether the decode pool can take a request.

    Contract: pure; ``now`` is the current time, ``prefill_done_at`` the predicted end of
    this request's prefill (>= now), ``decode_tokens`` its ``max_tokens`` (0: not known) and ``prompt_s`` its
    predicted prefill, which shares the steps of an instance that interleaves prefill (``SloAwareDecode``), and
    ``paced_budget_s`` the most that prefill may take paced (``SloAwareDecode.choose``; 0: no pacing). An
    accepted decision carries the decode instance judged best (None means: choose at hand-off). A
    rejection names its reason and a retry-after.
    """

    name: str

    def __init__(self, decode: SloAwareDecode) -> None:
        self.decode = decode

    @abstractmethod
    def admit(
        self, instances: Sequence[DecodeInstanceState], context_tokens: int, now: float, prefill_done_at: float,
        decode_tokens: int = 0, prompt_s: float = 0.0, paced_budget_s: float = 0.0,
    ) -> AdmissionDecision: ...


class NoAdmission(AdmissionPolicy):
    """Accept everything before prefill; overload is found only at hand-off."""

    name = "none"

    def admit(self, instances, context_tokens, now, prefill_done_at, decode_tokens=0, prompt_s=0.0,
              paced_budget_s=0.0):
        return AdmissionDecision(True, "ok", 0.0, self.decode.choose(instances, context_tokens))


class EarlyRejection(AdmissionPolicy):
    """Reject before prefill when no decode instance can take the request within SLO now."""

    name = "early"
    reason = "decode_overloaded"

    def _judged_at(self, now: float, prefill_done_at: float) -> float | None:
        return None

    def admit(self, instances, context_tokens, now, prefill_done_at, decode_tokens=0, prompt_s=0.0,
              paced_budget_s=0.0):
        at = self._judged_at(now, prefill_done_at)
        choice = self.decode.choose(instances, context_tokens, at, decode_tokens, prompt_s, paced_budget_s)
        if choice is not None:
            return AdmissionDecision(True, "ok", 0.0, choice)
        nearest = self.decode.nearest(instances, context_tokens, at, decode_tokens, prompt_s)
        return AdmissionDecision(False, self.reason, retry_after(instances, now), nearest,
                                 self.decode.clears_in(instances, context_tokens, at, decode_tokens, prompt_s))


class PredictiveEarlyRejection(EarlyRejection):
    """Reject before prefill when the decode pool is predicted over SLO when the prefill ends."""

    name = "predictive"
    reason = "decode_overloaded_predicted"

    def _judged_at(self, now: float, prefill_done_at: float) -> float | None:
        return max(now, prefill_done_at)


ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    cls.name: cls for cls in (NoAdmission, EarlyRejection, PredictiveEarlyRejection)
}


def make_admission(name: str, decode: SloAwareDecode) -> AdmissionPolicy:
    try:
        return ADMISSION_POLICIES[name](decode)
    except KeyError:
        raise ValueError(f"unknown admission policy {name!r}; choose from {sorted(ADMISSION_POLICIES)}") from None
