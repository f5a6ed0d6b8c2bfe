"""Placement policies: which prefill and decode instance serve a request (or which aggregated
instance serves both phases). Pure code.

The cache- and SLO-aware policy (kv_placement.py, over shared/halfmoon/policy/) implements the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from halfmoon.core.kv_spec import KVSpec
from halfmoon.policy.calibration import TTFTCalibration
from halfmoon.protocol.scheduling import RejectReason, ScheduleRequest
from halfmoon.services.conductor.registry import InstanceView


class Placement(NamedTuple):
    prefill: str
    decode: str
    predicted_ttft_ms: float | None = None
    reused_tokens: int = 0  # prompt tokens the chosen prefill instance is expected to reuse
    prefill_s: float = 0.0  # predicted prefill work (transfer and compute) it adds to that instance
    pipeline: tuple[str, ...] = ()  # CPP: the prefill instances running the later layers with ``prefill``
    model_ttft_ms: float | None = None  # the cost model's TTFT before calibration (what calibration learns from)
    predicted_tbt_ms: float | None = None  # the decode instance's predicted step time with this request in it
    # both a pair and aggregated instances were live: the predicted cost of each option (policy/disaggregation.py)
    handoff_cost_s: float | None = None
    whole_cost_s: float | None = None
    step_target_s: float = 0.0  # an aggregated instance paces the prompt's chunks to this step (0: unpaced)

    @property
    def whole(self) -> bool:
        """One instance prefills and decodes it (an aggregated instance)."""
        return self.prefill == self.decode


class Rejection(NamedTuple):
    reason: RejectReason
    message: str
    retry_after_s: float | None = None  # None: the conductor's configured default
    clears_in_s: float | None = None  # ScheduleRejected's


class PlacementPolicy(ABC):
    """Chooses a (prefill, decode) pair for ``request`` among live, non-draining candidates.

    Contract: no I/O and no clock (``now`` is passed in); the same inputs give the same answer. Returns a
    :class:`Rejection` (never raises) when no acceptable pair exists, so the caller can
    reject early instead of wasting prefill.
    """

    def adopt(self, spec: KVSpec, instance_id: str) -> None:  # noqa: B027 - accepting every identity is the default
        """Learn the deployment's KV identity from an engine instance's heartbeat.

        Raises :class:`KVSpecMismatch` when ``instance_id`` disagrees with the identity already
        adopted; the caller then refuses that instance. Policies that ignore block keys accept all.
        """

    calibration: TTFTCalibration | None = None  # set by policies that predict TTFTs

    def observe_ttft(self, model_ttft_s: float, delivered_s: float, now: float) -> None:
        """A request placed with ``model_ttft_s`` (``Placement.model_ttft_ms``) got its first token after
        ``delivered_s``: the calibration of later predictions learns from it."""
        if self.calibration is not None:
            self.calibration.record(model_ttft_s, delivered_s, now)

    @abstractmethod
    def place(
        self, request: ScheduleRequest, prefill: Sequence[InstanceView], decode: Sequence[InstanceView],
        now: float = 0.0,
    ) -> Placement | Rejection: ...

    @abstractmethod
    def place_mixed(
        self, request: ScheduleRequest, prefill: Sequence[InstanceView], decode: Sequence[InstanceView],
        aggregated: Sequence[InstanceView], now: float = 0.0,
    ) -> Placement | Rejection:
        """A prefill/decode pair and aggregated instances are all live: hand the request off to a pair, or
        serve it whole on one aggregated instance (``Placement.whole``)."""


class LeastLoaded(PlacementPolicy):
    """Fewest pending requests (reported, or placed and not done); decode ties go to more free KV blocks,
    remaining ties to the smallest instance id."""

    def place(
        self, request: ScheduleRequest, prefill: Sequence[InstanceView], decode: Sequence[InstanceView],
        now: float = 0.0,
    ) -> Placement | Rejection:
        if not prefill:
            return Rejection(RejectReason.NO_PREFILL_INSTANCE, "no live prefill instance is taking work")
        if not decode:
            return Rejection(RejectReason.NO_DECODE_INSTANCE, "no live decode instance is taking work")
        p = min(prefill, key=lambda v: (v.pending, v.instance_id))
        d = min(decode, key=lambda v: (v.pending, -v.load.free_kv_blocks, v.instance_id))
        return Placement(p.instance_id, d.instance_id)

    def place_mixed(
        self, request: ScheduleRequest, prefill: Sequence[InstanceView], decode: Sequence[InstanceView],
        aggregated: Sequence[InstanceView], now: float = 0.0,
    ) -> Placement | Rejection:
        """Whole on the least loaded aggregated instance when it holds fewer requests than the least loaded
        decode instance (decoding is where both options spend the request's life), else handed off."""
        a = min(aggregated, key=lambda v: (v.pending, -v.load.free_kv_blocks, v.instance_id))
        if a.pending < min(v.pending for v in decode):
            return Placement(a.instance_id, a.instance_id)
        return self.place(request, prefill, decode, now)


def place_pair(policy: PlacementPolicy, request: ScheduleRequest, prefill: Sequence[InstanceView],
               decode: Sequence[InstanceView], aggregated: Sequence[InstanceView], now: float) -> Placement | Rejection:
    """A prefill/decode pair when both pools have live instances and no aggregated one is; one aggregated
    instance for both phases (its own decode, whatever the policy's decode choice) when no pair is; the
    policy's choice between the two when both are."""
    if aggregated and not (prefill and decode):
        choice = policy.place(request, aggregated, aggregated, now)
        return choice._replace(decode=choice.prefill) if isinstance(choice, Placement) else choice
    if aggregated:
        return policy.place_mixed(request, prefill, decode, aggregated, now)
    return policy.place(request, prefill, decode, now)
