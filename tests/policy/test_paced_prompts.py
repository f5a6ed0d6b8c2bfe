"""A long prompt beside decoding sequences: admitted paced where its own work alone would hold them past the
TBT SLO, its chunks kept to a share of the SLO and its TTFT stretched by what that leaves it."""

import pytest

from halfmoon.policy.admission import PredictiveEarlyRejection
from halfmoon.policy.cost import CostModels, DecodeCostModel, PrefillCostModel, TransferModel
from halfmoon.policy.decode import PACED_STEP_SHARE, SloAwareDecode
from halfmoon.policy.disaggregation import PerRequestDisaggregation, Serving
from halfmoon.policy.prefill import LocalCacheAwarePrefill
from halfmoon.policy.scheduler import KVCentricScheduler
from halfmoon.policy.state import SLO, DecodeInstanceState, PrefillInstanceState, RouteRequest

SLO_200MS = SLO(ttft_s=30.0, tbt_s=0.2)
STEP_S = 0.05
TARGET_S = PACED_STEP_SHARE * SLO_200MS.tbt_s  # 0.15 s
DECODE = SloAwareDecode(DecodeCostModel((STEP_S, 0.0, 0.0)), SLO_200MS)
# the trace's case: ten sequences decoding with 32 tokens to go, 1 s of prompts queued ahead
DECODING = DecodeInstanceState("a0", 10, 0, 10**6, interleaves_prefill=True, queued_prefill_s=1.0,
                               paces_prompts=True)


def test_a_prompt_that_would_hold_its_neighbours_past_the_slo_is_admitted_paced() -> None:
    # unpaced, 0.05 + (1 + 8.5) / 32 = 0.347 s between their tokens; paced, at most the 0.15 s target, and
    # each 0.15 s step leaves the prompt 0.10 s: 8.5 s of work over 12.75 s
    choice = DECODE.choose([DECODING], 2_725, decode_tokens=32, prompt_s=8.5, paced_budget_s=29.0)
    assert choice is not None and choice.instance_id == "a0"
    assert choice.step_target_s == pytest.approx(TARGET_S)
    assert choice.paced_prompt_s == pytest.approx(8.5 * TARGET_S / (TARGET_S - STEP_S))
    assert choice.predicted_tbt_s == pytest.approx(STEP_S)  # the request's own gap once it decodes


def test_no_pace_where_the_engine_cannot_or_the_prompt_would_start_too_late() -> None:
    assert DECODE.choose([DECODING._replace(paces_prompts=False)], 2_725, decode_tokens=32, prompt_s=8.5,
                         paced_budget_s=29.0) is None
    assert DECODE.choose([DECODING], 2_725, decode_tokens=32, prompt_s=8.5, paced_budget_s=12.0) is None
    assert DECODE.choose([DECODING], 2_725, decode_tokens=32, prompt_s=8.5) is None  # no budget given: none


def test_no_pace_where_the_neighbours_are_past_the_slo_without_this_prompt_or_its_step_leaves_no_room() -> None:
    # the queue alone: 0.05 + 6 / 32 = 0.2375 s; pacing this prompt would not bring them within the SLO
    burst = DECODING._replace(queued_prefill_s=6.0)
    assert DECODE.choose([burst], 2_725, decode_tokens=32, prompt_s=8.5, paced_budget_s=29.0) is None
    # a decode step over the 0.15 s target: 0.16 + 2 / 32 = 0.2225 s unpaced, and paced no room for the prompt
    slow = SloAwareDecode(DecodeCostModel((0.16, 0.0, 0.0)), SLO_200MS)
    assert slow.choose([DECODING._replace(queued_prefill_s=0.0)], 2_725, decode_tokens=32, prompt_s=2.0,
                       paced_budget_s=29.0) is None


def test_an_instance_that_takes_the_prompt_unpaced_wins_over_one_that_would_pace_it() -> None:
    # a1 is busier, but its decoders have 400 tokens to go: 0.05 + 9.5 / 400 = 0.074 s unpaced
    roomy = DECODING._replace(id="a1", batch_size=14, decoders_tokens=400.0)
    choice = DECODE.choose([DECODING, roomy], 2_725, decode_tokens=32, prompt_s=8.5, paced_budget_s=29.0)
    assert choice is not None and choice.instance_id == "a1" and choice.step_target_s == 0.0


def test_the_scheduler_predicts_the_paced_ttft_and_rejects_where_it_misses_the_ttft_slo() -> None:
    cost = CostModels(prefill=PrefillCostModel((0.0, 8.5 / 2_725, 0.0, 0.0)), decode=DECODE.cost,
                      transfer=TransferModel(bytes_per_token=1.0, bandwidth_bytes_per_s=1e9, latency_s=0.0))
    scheduler = KVCentricScheduler(LocalCacheAwarePrefill(cost, SLO_200MS), PredictiveEarlyRejection(DECODE),
                                   SLO_200MS)
    request = RouteRequest(tuple(f"k{i}" for i in range(170)), 2_725, 16, 32)
    queued = PrefillInstanceState("a0", 1.0)
    decision = scheduler.schedule(request, [queued], [DECODING], {}, 0.0)
    assert decision.accepted and decision.decode is not None
    assert decision.decode.step_target_s == pytest.approx(TARGET_S)
    assert decision.prefill is not None
    assert decision.prefill.prefill_s == pytest.approx(8.5)  # the work the ledger holds: the prompt's own
    assert decision.prefill.ttft_s == pytest.approx(1.0 + decision.decode.paced_prompt_s)
    # waited 17 s for a placement: 17 + 1 + 12.75 > 30 s, and unpaced its neighbours miss: turned away
    late = scheduler.schedule(request._replace(waited_s=17.0), [queued], [DECODING], {}, 0.0)
    assert not late.accepted and late.reason == "decode_overloaded_predicted"


def test_requests_arriving_while_a_paced_prompt_runs_see_it_as_its_target_lets_them() -> None:
    """As on the trace: a paced prompt's 4.6 s of work, spread whole over the decoders' 32 tokens (0.072 +
    4.6 / 32 = 0.216 s), kept out the 2,725-token prompt that arrived 13 ms after it, which the same load
    without admission served within both SLOs."""
    pacing = DECODING._replace(queued_prefill_s=4.6, paced_prefill_s=4.6)
    # a short prompt: the paced one adds at most 0.15 - 0.05 s a gap, its own 1 s over 32 tokens 0.031 s
    assert DECODE.decoders_tbt(pacing, 300, 32, 1.0) == pytest.approx(TARGET_S + 1.0 / 32)
    choice = DECODE.choose([pacing], 300, decode_tokens=32, prompt_s=1.0)
    assert choice is not None and choice.step_target_s == 0.0
    # little paced work left: its share spread as before
    assert DECODE.decoders_tbt(pacing._replace(queued_prefill_s=1.0, paced_prefill_s=1.0), 300, 32, 1.0) == \
        pytest.approx(STEP_S + 2.0 / 32)
    # unpaced work queued beside it still counts whole
    assert DECODE.decoders_tbt(pacing._replace(queued_prefill_s=5.6), 300, 32, 1.0) == \
        pytest.approx(TARGET_S + 2.0 / 32)
    # what a rejection names is what the decoders see of the queue
    parts = DECODE.nearest([pacing._replace(queued_prefill_s=7.6)], 300, decode_tokens=32, prompt_s=1.0).parts
    assert parts is not None and parts.step_s == pytest.approx(STEP_S)
    assert parts.prompt_work_s == pytest.approx((TARGET_S - STEP_S) * 32 + 3.0 + 1.0)


def test_a_request_admitted_unpaced_beside_a_paced_prompt_is_predicted_the_steps_its_chunks_share() -> None:
    """As on the trace: requests placed behind the paced 2,725-token prompt were predicted 45 ms, the step
    alone, and got 144-223 ms between tokens while its chunks ran in their steps."""
    pacing = DECODING._replace(queued_prefill_s=4.6, paced_prefill_s=4.6)
    choice = DECODE.choose([pacing], 300, decode_tokens=32, prompt_s=1.0)
    assert choice is not None and choice.step_target_s == 0.0
    assert choice.predicted_tbt_s == pytest.approx(TARGET_S)  # 0.05 + min(4.6 / 32, 0.15 - 0.05)
    # little paced work left: its share over the request's own tokens
    little = DECODE.choose([pacing._replace(queued_prefill_s=1.0, paced_prefill_s=1.0)], 300, decode_tokens=64,
                           prompt_s=1.0)
    assert little is not None and little.predicted_tbt_s == pytest.approx(STEP_S + 1.0 / 64)
    # no paced work: the unpaced prompts queued ahead are done by its first token
    plain = DECODE.choose([pacing._replace(paced_prefill_s=0.0, queued_prefill_s=1.0)], 300, decode_tokens=32,
                          prompt_s=1.0)
    assert plain is not None and plain.predicted_tbt_s == pytest.approx(STEP_S)


def test_a_prompt_kept_out_by_the_queue_waits_for_it_to_drain_where_it_can_join_paced() -> None:
    """As on the trace: the 2,725-token prompt came 20 ms after nine others of its burst; their prompts
    alone put the decoders past the SLO, and its own alone too, so no wait was expected and it got a 429."""
    queued = DECODING._replace(queued_prefill_s=6.0)
    assert DECODE.choose([queued], 2_725, decode_tokens=32, prompt_s=8.5, paced_budget_s=29.0) is None
    # once 1.2 s of the queue has drained (0.05 + 4.8 / 32 = 0.2 s), it joins paced
    assert DECODE.clears_in([queued], 2_725, decode_tokens=32, prompt_s=8.5) == pytest.approx((0.05 + 6 / 32 - 0.2) * 32)
    drained = queued._replace(queued_prefill_s=6.0 - 1.2)
    choice = DECODE.choose([drained], 2_725, decode_tokens=32, prompt_s=8.5, paced_budget_s=29.0)
    assert choice is not None and choice.step_target_s > 0
    # an engine that does not pace: waiting would not let it in
    assert DECODE.clears_in([queued._replace(paces_prompts=False)], 2_725, decode_tokens=32, prompt_s=8.5) is None


def test_the_pace_of_prompts_lately_passing_is_waited_for_too() -> None:
    """As on the trace: steps lately 0.066 s, 0.018 s of it prompts, and the queue put the decoders at 0.21 s;
    with the pace's share taken off they were within the SLO, so no wait was expected and the prompt got a
    429."""
    paced_share = TARGET_S - STEP_S
    state = DECODING._replace(queued_prefill_s=4.0 + 1.0, paced_prefill_s=1.0, decoders_tokens=31.0,
                              prompt_excess_s=0.018)
    without_own = STEP_S + 4.0 / 31 + min(1.0 / 31, paced_share)
    assert without_own > 0.2 > without_own - 0.018
    wait = DECODE.clears_in([state], 2_725, decode_tokens=32, prompt_s=4.9)
    assert wait == pytest.approx((without_own - 0.2) * 31)


def test_with_pairs_beside_it_a_prompt_only_an_aggregated_instance_can_take_paced_is_served_whole_paced() -> None:
    """Both layouts live: the pair's decode instance is full, so the hand-off is no option; serving whole,
    judged unpaced, held the aggregated instance's decoders at 0.05 + (1 + 8.5) / 32 = 0.347 s and the prompt
    was turned away."""
    cost = CostModels(prefill=PrefillCostModel((0.0, 8.5 / 2_725, 0.0, 0.0)), decode=DECODE.cost,
                      transfer=TransferModel(bytes_per_token=1.0, bandwidth_bytes_per_s=1e9, latency_s=0.0))
    scheduler = KVCentricScheduler(LocalCacheAwarePrefill(cost, SLO_200MS), PredictiveEarlyRejection(DECODE),
                                   SLO_200MS)
    policy = PerRequestDisaggregation(DECODE, cost, SLO_200MS)
    request = RouteRequest(tuple(f"k{i}" for i in range(170)), 2_725, 16, 32)
    full = DecodeInstanceState("d0", 60, 10**6, 10**6)
    handoff = scheduler.schedule(request, [PrefillInstanceState("p0", 0.0)], [full], {}, 0.0)
    whole = scheduler.schedule(request, [PrefillInstanceState("a0", 1.0)], [DECODING], {}, 0.0)
    assert not handoff.accepted and whole.accepted and whole.decode is not None and whole.prefill is not None
    option = policy.whole(whole, [DECODING], request)
    assert option is not None
    assert option.ttft_s == pytest.approx(1.0 + 8.5 * TARGET_S / (TARGET_S - STEP_S))  # the scheduler's, once
    assert option.tbt_s == pytest.approx(TARGET_S)  # the queue ahead: 0.05 + 1 / 32, under the target
    decision = policy.choose(policy.handoff(handoff, [full], request), option)
    assert decision.serving is Serving.WHOLE
    # an aggregated instance that does not pace: neither option, a rejection
    unpaced = DECODING._replace(paces_prompts=False)
    whole = scheduler.schedule(request, [PrefillInstanceState("a0", 1.0)], [unpaced], {}, 0.0)
    assert policy.choose(policy.handoff(handoff, [full], request), policy.whole(whole, [unpaced], request)).serving is None
