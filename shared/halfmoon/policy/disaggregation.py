"""Per-request disaggregation: hand a request off (prefill on a prefill instance, decode on a decode
instance) or serve it whole on one aggregated instance, whichever is predicted cheaper within the SLOs.

Cost is the instance-seconds of work the request adds beyond its own decoding, which both options share:

- hand-off: the prefill instance's prefill and prefix pulls, the prompt's KV moved to the decode instance
  (``TransferModel.seconds`` of the prompt), and ``handoff_overhead_s``, the fixed work of a second
  instance taking the request (its admission, the KV's registration, the extra messages);
- whole: the aggregated instance's prefix pulls and prefill (with its own cache hit), the prefill counted
  once for the instance and once more for each of the ``b`` sequences it is decoding: its prefill chunks
  share their steps, so each of their tokens waits that long too. ``cost = transfer_s + prefill_s * (1 + b)``.

An aggregated instance prefills ``chunk_tokens`` of a prompt per step (the engines' ``prefill_chunk_size``),
each step also decoding its batch. Serving whole is therefore judged by the TBT its batch sees while the
prompt's chunks ride along (the slowest such step, the last chunk's, which attends to the whole prompt)
as well as the TBT with the request decoding, and its TTFT adds one step of that batch per chunk.

So a short or mostly cached prompt (little prefill) is served whole, and so is any prompt on an idle
aggregated instance (nothing to slow down) unless another instance holds its prefix; a long uncached
prompt beside a decoding batch is handed off: its prefill there would slow every token of the batch.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

from halfmoon.policy.cost import CostModels
from halfmoon.policy.decode import SloAwareDecode, anchored
from halfmoon.policy.scheduler import ScheduleDecision
from halfmoon.policy.state import SLO, DecodeInstanceState, RouteRequest


class Serving(enum.Enum):
    HANDOFF = "handoff"
    WHOLE = "whole"


class ServingOption(NamedTuple):
    """One way to serve a request, as predicted: its TTFT (queue, transfers, prefill), the TBT its decode
    instance is predicted to deliver with it, and ``cost_s`` (the module's definition). ``idle``: its
    decode instance has nothing running, which qualifies it whatever its predicted TBT where the decode
    choice lets idle instances qualify (``SloAwareDecode.idle_qualifies``)."""

    ttft_s: float
    tbt_s: float
    cost_s: float
    idle: bool = False


class DisaggregationDecision(NamedTuple):
    """``serving`` is None when neither option meets the SLOs; both options are kept for the record."""

    serving: Serving | None
    handoff: ServingOption | None
    whole: ServingOption | None


class PerRequestDisaggregation:
    """Chooses between the hand-off and serving whole for one request.

    Contract: pure (no I/O, no clock). ``choose`` takes the predicted options (None: that option is not
    available, e.g. its pool is empty or the scheduler rejected it) and returns the one of lower cost
    among those meeting the SLOs (TTFT within ``slo.ttft_s`` and TBT within ``slo.tbt_s``, or an idle
    decode instance when ``idle_qualifies``); a tie serves whole (nothing to move). Neither meeting them:
    ``serving`` is None, a rejection, unless the request was ``admitted`` before (a migration): then the
    lower cost of those available. ``handoff`` and ``whole`` build the options from the scheduler's
    decisions for the two pools.
    """

    def __init__(self, decode: SloAwareDecode, cost: CostModels, slo: SLO = SLO(),
                 handoff_overhead_s: float = 0.02, chunk_tokens: int = 512) -> None:
        if handoff_overhead_s < 0:
            raise ValueError(f"handoff_overhead_s must be >= 0, got {handoff_overhead_s}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.decode = decode
        self.cost = cost
        self.slo = slo
        self.handoff_overhead_s = handoff_overhead_s

    def meets(self, option: ServingOption, waited_s: float = 0.0) -> bool:
        """``waited_s``: how long the request already waited for a placement, part of its TTFT."""
        if waited_s + option.ttft_s > self.slo.ttft_s:
            return False
        return option.tbt_s <= self.slo.tbt_s or (option.idle and self.decode.idle_qualifies)

    def choose(self, handoff: ServingOption | None, whole: ServingOption | None,
               admitted: bool = False, waited_s: float = 0.0) -> DisaggregationDecision:
        available = {serving: option for serving, option in ((Serving.HANDOFF, handoff), (Serving.WHOLE, whole))
                     if option is not None}
        meeting = {s: o for s, o in available.items() if self.meets(o, waited_s)} or (available if admitted else {})
        best = min(meeting, key=lambda s: (meeting[s].cost_s, s != Serving.WHOLE), default=None)
        return DisaggregationDecision(best, handoff, whole)

    def handoff_cost(self, prefill_s: float, transfer_s: float, prompt_tokens: int) -> float:
        return prefill_s + transfer_s + self.cost.transfer.seconds(prompt_tokens) + self.handoff_overhead_s

    @staticmethod
    def whole_cost(prefill_s: float, transfer_s: float, batch: int) -> float:
        return transfer_s + prefill_s * (1 + batch)

    def _step_s(self, state: DecodeInstanceState) -> float:
        """The instance's decoding step for its batch now (0 when it decodes none)."""
        if state.batch_size <= 0:
            return 0.0
        return anchored(self.decode.cost, state.measured, state.batch_size, state.context_tokens)

    def interleaved_s(self, state: DecodeInstanceState, new_tokens: int) -> float:
        """Seconds of decoding steps a prompt of ``new_tokens`` rides on at ``state``."""
        return -(-max(new_tokens, 0) // self.chunk_tokens) * self._step_s(state)

    def shared_tbt_s(self, state: DecodeInstanceState, request: RouteRequest, new_tokens: int) -> float:
        """The step the instance's batch takes with this prompt's last chunk in it (0 when it decodes none)."""
        if state.batch_size <= 0 or new_tokens <= 0:
            return 0.0
        chunk = min(self.chunk_tokens, new_tokens)
        return self._step_s(state) + self.cost.prefill.predict(chunk, request.prompt_tokens - chunk)

    def handoff(self, decision: ScheduleDecision, decode: Sequence[DecodeInstanceState],
                request: RouteRequest) -> ServingOption | None:
        """The hand-off as the scheduler decided it over the prefill and decode pools (None: rejected). With
        no decode instance chosen yet (admission ``none``), the TBT is the nearest instance's."""
        if not decision.accepted or decision.prefill is None:
            return None
        p = decision.prefill
        chosen = decision.decode or self.decode.nearest(decode, request.prompt_tokens)
        tbt = chosen.predicted_tbt_s if chosen is not None else 0.0
        idle = chosen is not None and any(s.id == chosen.instance_id and s.batch_size == 0 for s in decode)
        return ServingOption(p.ttft_s, tbt, self.handoff_cost(p.prefill_s, p.transfer_s, request.prompt_tokens),
                             idle)

    def whole(self, decision: ScheduleDecision, aggregated: Sequence[DecodeInstanceState],
              request: RouteRequest) -> ServingOption | None:
        """Serving whole on the aggregated instance the scheduler chose to prefill (None: rejected): the
        slower of its TBT with the request added (and the prompts queued there and its own, ``SloAwareDecode``) and its
        batch's step with the prompt's last chunk in it, and a TTFT that counts the decoding steps the
        chunks ride on. Where the scheduler admitted the prompt only paced (``DecodeChoice.step_target_s``), the
        batch sees the prompts queued ahead of it and at most the target while its chunks run. Judged unpaced
        instead, such a prompt was turned away wherever the hand-off could not take it in time either."""
        if not decision.accepted or decision.prefill is None:
            return None
        p = decision.prefill
        state = next(s for s in aggregated if s.id == p.instance_id)
        cost = self.whole_cost(p.prefill_s, p.transfer_s, state.batch_size)
        target = decision.step_target_s
        if target:
            # admitted paced: its chunks keep the steps they share within the target, and the scheduler's TTFT
            # already spans the steps they ride on
            tbt = max(self.decode.decoders_tbt(state, request.prompt_tokens, request.max_tokens, 0.0, aggregated),
                      target)
            return ServingOption(p.ttft_s, tbt, cost, state.batch_size == 0)
        new_tokens = request.prompt_tokens - request.cached_tokens(p.prefix_blocks)
        tbt = max(self.decode.decoders_tbt(state, request.prompt_tokens, request.max_tokens, p.prefill_s, aggregated),
                  self.shared_tbt_s(state, request, new_tokens))
        return ServingOption(p.ttft_s + self.interleaved_s(state, new_tokens), tbt, cost, state.batch_size == 0)
