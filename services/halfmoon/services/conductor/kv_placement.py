"""Mooncake's KVCache-centric placement on the live instance set: the shared policy code
(Algorithm 1, SLO-aware decode choice, early rejection) fed from heartbeats and KV events."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from halfmoon.core.kv_spec import KVSpec
from halfmoon.policy.calibration import TTFTCalibration
from halfmoon.policy.disaggregation import PerRequestDisaggregation, Serving, ServingOption
from halfmoon.policy.scheduler import KVCentricScheduler, ScheduleDecision
from halfmoon.policy.state import DecodeInstanceState, MeasuredStep, PrefillInstanceState, RouteRequest
from halfmoon.protocol.registry import Role, StepSample, pooled_steps
from halfmoon.protocol.scheduling import RejectReason, ScheduleRequest
from halfmoon.services.conductor.kv_index import LiveBlockIndex
from halfmoon.services.conductor.placement import LeastLoaded, Placement, PlacementPolicy, Rejection
from halfmoon.services.conductor.registry import InstanceView


class KVCentricPlacement(PlacementPolicy):
    """Contract: pure given its inputs and ``now``; the caller owns the block index, the cost
    fitter and the per-instance work estimate, and feeds them from events.

    Block keys need the deployment's KV identity, which the first engine heartbeat brings
    (``adopt``); until then requests are placed least-loaded.

    A prefill instance's queue wait is the predicted prefill work of the placements the conductor's
    ledger holds for it, plus, for requests it reports beyond those, their mean; a decode instance's
    context is its used KV blocks (heartbeat) in tokens.

    Where a pair and aggregated instances are both live (``place_mixed``), the scheduler decides for each
    (the aggregated instances as both pools) and :class:`PerRequestDisaggregation` picks the cheaper within
    the SLOs; ``handoff_overhead_s`` is its fixed cost of a hand-off.
    """

    def __init__(self, make_scheduler: Callable[[KVSpec], KVCentricScheduler], index: LiveBlockIndex,
                 calibration: TTFTCalibration | None = None, pools_steps: bool = True,
                 handoff_overhead_s: float = 0.02) -> None:
        self.make_scheduler = make_scheduler
        self.handoff_overhead_s = handoff_overhead_s
        self.disaggregation: PerRequestDisaggregation | None = None
        self.pools_steps = pools_steps  # one cost model learns steps with and without prefill chunks alike
        self.index = index
        self.calibration = calibration
        self.spec: KVSpec | None = None
        self.scheduler: KVCentricScheduler | None = None
        self._before_spec = LeastLoaded()

    @property
    def block_size(self) -> int:
        assert self.spec is not None
        return self.spec.block_size

    def adopt(self, spec: KVSpec, instance_id: str) -> None:
        if self.spec is None:
            self.spec, self.scheduler = spec, self.make_scheduler(spec)
            self.disaggregation = PerRequestDisaggregation(
                self.scheduler.admission.decode, self.scheduler.prefill.cost, self.scheduler.slo,
                self.handoff_overhead_s)
        else:
            self.spec.check_shares_blocks_with(spec, instance_id)

    def route(self, request: ScheduleRequest) -> RouteRequest:
        assert self.spec is not None
        keys = self.spec.hasher(request.tenant_salt).keys(request.prompt_token_ids)
        return RouteRequest(tuple(keys), len(request.prompt_token_ids), self.block_size, request.sampling.max_tokens,
                            admitted=request.attempt > 0, waited_s=request.waited_s)

    @staticmethod
    def _scale(view: InstanceView) -> float:
        """How much the ledger's placed prompt work on ``view`` is scaled up by: more than 1 where the instance
        reports more requests waiting than the ledger holds (placed by a conductor this one took over from),
        each at the ledger's mean. Waiting, not running: a heartbeat lags the ledger by
        up to an interval, and when a wave of 8 streams ended together the last one still said 8 running
        while the ledger held the one request placed since; scaled by those, its prompt counted eight times
        (11.7 s of predicted TTFT) and the next 31 requests were turned away."""
        placed = view.outstanding
        return max(1.0, view.load.queue_len / placed.requests) if placed.requests else 0.0

    def _queued(self, view: InstanceView) -> tuple[float, int]:
        """Prompt work placed on ``view`` and not yet computed: (seconds, tokens), scaled (``_scale``)."""
        scale = self._scale(view)
        return view.outstanding.work_s * scale, round(view.outstanding.tokens * scale)

    def _prefill_state(self, view: InstanceView) -> PrefillInstanceState:
        """A prompt admitted paced is no queue to wait behind: the engine computes the prompts after it beside
        its chunks, which take only what their step target leaves."""
        seconds, tokens = self._queued(view)
        seconds -= view.outstanding.paced_work_s * self._scale(view)
        recent = (view.load.ttft_ms / 1000,) if view.load.ttft_ms is not None else ()
        return PrefillInstanceState(view.instance_id, seconds, tokens, recent)

    def _decode_state(self, view: InstanceView) -> DecodeInstanceState:
        used = view.load.total_kv_blocks - view.load.free_kv_blocks
        recent = (view.load.tbt_ms / 1000,) if view.load.tbt_ms is not None else ()
        batch = max(view.running, view.outstanding.requests)
        aggregated = view.role is Role.AGGREGATED
        steps, shared = view.load.steps, view.load.shared_steps
        prompt_excess = 0.0
        if self.pools_steps:
            if view.load.window_steps is not None:
                steps, prompt_excess = view.load.window_steps, view.load.window_prompt_s
            else:
                steps = pooled_steps(steps, shared)
            shared = None
        return DecodeInstanceState(view.instance_id, batch, used * self.block_size,
                                   view.load.total_kv_blocks * self.block_size, recent,
                                   interleaves_prefill=aggregated, measured=measured_step(steps),
                                   measured_shared=measured_step(shared),
                                   shared_step_fraction=view.load.shared_step_fraction if aggregated else None,
                                   queued_prefill_s=self._queued(view)[0] if aggregated else 0.0,
                                   paced_prefill_s=view.outstanding.paced_work_s * self._scale(view) if aggregated else 0.0,
                                   decoders_tokens=view.outstanding.mean_decode_tokens,
                                   prompt_excess_s=prompt_excess if aggregated else 0.0,
                                   paces_prompts=aggregated and view.paces_prompts)

    def place(self, request: ScheduleRequest, prefill: Sequence[InstanceView], decode: Sequence[InstanceView],
              now: float = 0.0) -> Placement | Rejection:
        if not prefill:
            return Rejection(RejectReason.NO_PREFILL_INSTANCE, "no live prefill instance is taking work")
        if not decode:
            return Rejection(RejectReason.NO_DECODE_INSTANCE, "no live decode instance is taking work")
        if self.scheduler is None:
            return self._before_spec.place(request, prefill, decode, now)
        decision = self.scheduler.schedule(self.route(request), [self._prefill_state(v) for v in prefill],
                                           [self._decode_state(v) for v in decode], self.index, now)
        return self._placement(decision, decode)

    def place_mixed(self, request: ScheduleRequest, prefill: Sequence[InstanceView], decode: Sequence[InstanceView],
                    aggregated: Sequence[InstanceView], now: float = 0.0) -> Placement | Rejection:
        if self.scheduler is None or self.disaggregation is None:
            return self._before_spec.place_mixed(request, prefill, decode, aggregated, now)
        route = self.route(request)
        decode_states = [self._decode_state(v) for v in decode]
        whole_states = [self._decode_state(v) for v in aggregated]
        handoff = self.scheduler.schedule(route, [self._prefill_state(v) for v in prefill], decode_states,
                                          self.index, now)
        whole = self.scheduler.schedule(route, [self._prefill_state(v) for v in aggregated], whole_states,
                                        self.index, now)
        chosen = self.disaggregation.choose(self.disaggregation.handoff(handoff, decode_states, route),
                                            self.disaggregation.whole(whole, whole_states, route), route.admitted,
                                            route.waited_s)
        handoff_cost = chosen.handoff.cost_s if chosen.handoff else None
        whole_cost = chosen.whole.cost_s if chosen.whole else None
        if chosen.serving is Serving.WHOLE:
            assert chosen.whole is not None and whole.prefill is not None
            placement = self._placement(whole, aggregated)
            assert isinstance(placement, Placement)
            # its work there: the prompt's transfer and prefill, and the decoding steps its chunks ride on; no
            # pipeline (that is a hand-off's)
            return placement._replace(decode=placement.prefill, pipeline=(), predicted_ttft_ms=chosen.whole.ttft_s * 1000,
                                      prefill_s=chosen.whole.ttft_s - whole.prefill.queue_s,
                                      predicted_tbt_ms=chosen.whole.tbt_s * 1000,
                                      handoff_cost_s=handoff_cost, whole_cost_s=whole_cost)
        if chosen.serving is Serving.HANDOFF:
            placement = self._placement(handoff, decode)
            assert isinstance(placement, Placement)
            return placement._replace(handoff_cost_s=handoff_cost, whole_cost_s=whole_cost)
        if not (handoff.accepted or whole.accepted):
            return self._placement(handoff, decode)  # the scheduler's own reason
        return Rejection(RejectReason.OVERLOADED, "no_option_within_slo: neither the hand-off nor serving whole is "
                         f"predicted within the SLOs (hand-off {_figures(chosen.handoff)}, whole {_figures(chosen.whole)})")

    def _placement(self, decision: ScheduleDecision, decode: Sequence[InstanceView]) -> Placement | Rejection:
        if not decision.accepted:
            figures = [f"TTFT {decision.prefill.ttft_s:.2f}s"] if decision.prefill else []
            if decision.decode is not None:  # the nearest miss of a decode rejection
                parts = decision.decode.parts
                figures.append(f"TBT {decision.decode.predicted_tbt_s:.3f}s"
                               + ("" if parts is None else f" = {parts.describe()}"))
            predicted = f" (predicted {', '.join(figures)})" if figures else ""
            return Rejection(RejectReason.OVERLOADED, f"{decision.reason}{predicted}", decision.retry_after_s,
                             decision.clears_in_s)
        assert decision.prefill is not None
        chosen = decision.prefill
        decode_id = decision.decode.instance_id if decision.decode else min(
            decode, key=lambda v: (max(v.running, v.outstanding.requests), v.instance_id)).instance_id
        pipeline = decision.pipeline.stages[1:] if decision.pipeline else ()
        return Placement(chosen.instance_id, decode_id, chosen.ttft_s * 1000, chosen.prefix_blocks * self.block_size,
                         chosen.transfer_s + chosen.prefill_s, pipeline, decision.model_ttft_s * 1000,
                         decision.decode.predicted_tbt_s * 1000 if decision.decode else None,
                         step_target_s=decision.step_target_s)


def _figures(option: ServingOption | None) -> str:
    if option is None:
        return "rejected"
    return f"TTFT {option.ttft_s:.2f}s, TBT {option.tbt_s:.3f}s"


def measured_step(sample: StepSample | None) -> MeasuredStep | None:
    return None if sample is None else MeasuredStep(sample.batch, sample.kv_tokens, sample.seconds)
