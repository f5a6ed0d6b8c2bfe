"""The Conductor's decision for one request: Algorithm 1 plus admission, as pure code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from halfmoon.policy.admission import MIN_RETRY_AFTER_S, AdmissionPolicy
from halfmoon.policy.calibration import TTFTCalibration
from halfmoon.policy.cpp import CppPlan, CppPolicy
from halfmoon.policy.decode import DecodeChoice
from halfmoon.policy.prefill import PrefillChoice, PrefillPolicy
from halfmoon.policy.state import (
    SLO,
    BlockIndex,
    DecodeInstanceState,
    PrefillInstanceState,
    RouteRequest,
)


class ScheduleDecision(NamedTuple):
    """Accepted: ``prefill`` is set and ``decode`` may be None (choose at hand-off).
    Rejected: ``reason`` says why and ``retry_after_s`` feeds the 429 Retry-After header; a decode
    rejection's ``decode`` is the instance that came nearest, with its predicted TBT.
    ``pipeline`` is set when the prompt is prefilled by a CPP pipeline; ``prefill`` then carries
    the pipeline's predicted times and its first stage. ``prefill.ttft_s`` is calibrated to the TTFTs
    delivered lately (policy/calibration.py); ``model_ttft_s`` is the cost model's own prediction.
    ``clears_in_s``: a decode rejection's wait until the prompt work queued ahead, and the pace of prompts
    lately, let the request in (None: waiting would not; a TTFT rejection's wait counts against its SLO as
    fast as the queue drains)."""

    accepted: bool
    reason: str
    retry_after_s: float
    prefill: PrefillChoice | None
    decode: DecodeChoice | None
    pipeline: CppPlan | None = None
    model_ttft_s: float = 0.0
    clears_in_s: float | None = None

    @property
    def step_target_s(self) -> float:
        """The step the prompt's chunks keep within where it was admitted paced (0: not paced)."""
        return self.decode.step_target_s if self.decode is not None else 0.0


class KVCentricScheduler:
    """Prefill choice, then the TTFT-SLO check (Algorithm 1 line 18), then decode admission; a request
    ``admitted`` before skips both and takes the decode instance admission judged best or nearest.

    Contract: pure apart from ``calibration``, which the caller feeds with delivered TTFTs; the caller
    applies the decision (enqueue, pull blocks, reserve decode).
    """

    def __init__(
        self, prefill: PrefillPolicy, admission: AdmissionPolicy, slo: SLO = SLO(), cpp: CppPolicy | None = None,
        calibration: TTFTCalibration | None = None,
    ) -> None:
        self.prefill = prefill
        self.admission = admission
        self.slo = slo
        self.cpp = cpp
        self.calibration = calibration

    def schedule(
        self,
        request: RouteRequest,
        prefill_states: Sequence[PrefillInstanceState],
        decode_states: Sequence[DecodeInstanceState],
        index: BlockIndex,
        now: float,
    ) -> ScheduleDecision:
        choice = self.prefill.choose(request, prefill_states, index)
        pipeline = None
        if self.cpp is not None:
            cached = request.cached_tokens(choice.prefix_blocks)
            pipeline = self.cpp.plan(request.prompt_tokens, cached, choice, prefill_states)
            if pipeline is not None:
                choice = choice._replace(ttft_s=pipeline.ttft_s, queue_s=pipeline.queue_s,
                                         prefill_s=pipeline.prefill_s, transfer_s=pipeline.transfer_s)
        model_ttft = choice.ttft_s
        if self.calibration is not None:
            choice = choice._replace(ttft_s=self.calibration.correct(model_ttft, now))
        if request.waited_s + choice.ttft_s > self.slo.ttft_s and not request.admitted:
            wait = max(MIN_RETRY_AFTER_S, request.waited_s + choice.ttft_s - self.slo.ttft_s)
            return ScheduleDecision(False, "ttft_slo", wait, choice, None, pipeline, model_ttft)
        paced_budget = self.slo.ttft_s - request.waited_s - (choice.ttft_s - choice.prefill_s)
        verdict = self.admission.admit(decode_states, request.prompt_tokens, now, now + choice.ttft_s,
                                       request.max_tokens, choice.prefill_s, max(0.0, paced_budget))
        if not verdict.accepted and not request.admitted:
            return ScheduleDecision(False, verdict.reason, verdict.retry_after_s, choice, verdict.decode, pipeline,
                                    model_ttft, verdict.clears_in_s)
        if verdict.decode is not None and verdict.decode.step_target_s:
            # paced, the prompt's chunks span longer than its work (which the ledger keeps as prefill_s)
            stretch = verdict.decode.paced_prompt_s - choice.prefill_s
            choice, model_ttft = choice._replace(ttft_s=choice.ttft_s + stretch), model_ttft + stretch
        return ScheduleDecision(True, "ok", 0.0, choice, verdict.decode, pipeline, model_ttft)
