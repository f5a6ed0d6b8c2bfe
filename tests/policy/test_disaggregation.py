"""Per-request disaggregation: the hand-off or serving whole, by predicted cost within the SLOs.

Costs from the hand-made models in conftest.py (1 ms per new prompt token, 1 us per transferred token)
and a 20 ms hand-off overhead: whole costs ``prefill * (1 + batch)``, the hand-off ``prefill + transfer +
20 ms``. Beside a batch of 8, serving whole pays for prompts under about 2.5 new tokens."""

import pytest

from halfmoon.policy.admission import EarlyRejection
from halfmoon.policy.decode import SloAwareDecode
from halfmoon.policy.disaggregation import PerRequestDisaggregation, Serving, ServingOption
from halfmoon.policy.prefill import LocalCacheAwarePrefill
from halfmoon.policy.scheduler import KVCentricScheduler
from halfmoon.policy.state import SLO, DecodeInstanceState, DecodeWork, PrefillInstanceState, RouteRequest

SLOS = SLO(ttft_s=30.0, tbt_s=0.1)
BLOCK = 4


def decoding(id_: str, batch: int, context: int) -> DecodeInstanceState:
    work = tuple(DecodeWork(context // batch, 0.0, 100.0) for _ in range(batch)) if batch else ()
    return DecodeInstanceState(id_, batch, context, 10**6, work=work, interleaves_prefill=id_.startswith("a"))


class Deployment:
    """One prefill, one decode and one aggregated instance, the decoding ones each running ``batch``."""

    def __init__(self, cost, batch: int = 8, slo: SLO = SLOS) -> None:
        decode = SloAwareDecode(cost.decode, slo)
        self.scheduler = KVCentricScheduler(LocalCacheAwarePrefill(cost, slo), EarlyRejection(decode), slo)
        self.policy = PerRequestDisaggregation(decode, cost, slo, handoff_overhead_s=0.02)
        self.prefill = [PrefillInstanceState("p0", 0.0)]
        self.decode = [decoding("d0", batch, batch * 500)]
        self.aggregated = [decoding("a0", batch, batch * 500)]
        self.index: dict = {}

    def serve(self, prompt_tokens: int, key_prefix: str = "k"):
        request = RouteRequest(tuple(f"{key_prefix}{i}" for i in range(prompt_tokens // BLOCK)), prompt_tokens, BLOCK)
        handoff = self.scheduler.schedule(request, self.prefill, self.decode, self.index, 0.0)
        whole = self.scheduler.schedule(request, [PrefillInstanceState("a0", 0.0)], self.aggregated, self.index, 0.0)
        return self.policy.choose(self.policy.handoff(handoff, self.decode, request),
                                  self.policy.whole(whole, self.aggregated, request))


class TestByCost:
    def test_a_short_prompt_is_served_whole_and_a_long_one_handed_off(self, cost):
        deployment = Deployment(cost)
        short = deployment.serve(2)
        assert short.serving is Serving.WHOLE
        assert short.whole.cost_s == pytest.approx(0.002 * 9) and short.handoff.cost_s == pytest.approx(0.022, abs=1e-4)
        long = deployment.serve(1000)
        assert long.serving is Serving.HANDOFF
        assert long.whole.cost_s == pytest.approx(1.0 * 9) and long.handoff.cost_s == pytest.approx(1.021)

    def test_serving_whole_the_first_token_waits_for_the_steps_the_chunks_ride_on(self, cost):
        # 1,000 new tokens in chunks of 512: two steps of the batch of 8 over 4,000 tokens, 22 ms each
        long = Deployment(cost).serve(1000)
        assert long.whole.ttft_s == pytest.approx(1.0 + 2 * 0.022) and long.handoff.ttft_s == pytest.approx(1.0)
        assert Deployment(cost, batch=0).serve(1000).whole.ttft_s == pytest.approx(1.0)

    def test_a_long_prompt_the_aggregated_instance_holds_is_served_whole(self, cost):
        deployment = Deployment(cost)
        deployment.index = {f"k{i}": {"a0"} for i in range(250)}  # 1000 tokens; the prefill instance has none
        chosen = deployment.serve(1000)
        assert chosen.serving is Serving.WHOLE
        assert chosen.whole.cost_s == pytest.approx(0.001 * 9)  # one token computed

    def test_an_idle_aggregated_instance_takes_a_long_prompt_nothing_holds(self, cost):
        chosen = Deployment(cost, batch=0).serve(1000)
        assert chosen.serving is Serving.WHOLE  # no batch to slow, no KV to move
        assert chosen.whole.cost_s < chosen.handoff.cost_s

    def test_the_hand_off_costs_what_it_moves(self, cost):
        policy = Deployment(cost).policy
        assert policy.handoff_cost(1.0, 0.5, 10_000) == pytest.approx(1.0 + 0.5 + 0.01 + 0.02)
        assert policy.whole_cost(1.0, 0.5, batch=3) == pytest.approx(0.5 + 4.0)


class TestBySlo:
    def policy(self, cost) -> PerRequestDisaggregation:
        return Deployment(cost).policy

    def test_the_cheaper_option_missing_an_slo_gives_way_to_the_other(self, cost):
        policy = self.policy(cost)
        cheap_but_slow_tokens = ServingOption(ttft_s=1.0, tbt_s=0.2, cost_s=0.01)
        dear = ServingOption(ttft_s=2.0, tbt_s=0.05, cost_s=1.0)
        assert policy.choose(dear, cheap_but_slow_tokens).serving is Serving.HANDOFF
        late_first_token = ServingOption(ttft_s=31.0, tbt_s=0.05, cost_s=0.01)
        assert policy.choose(late_first_token, dear).serving is Serving.WHOLE

    def test_both_missing_is_a_rejection_and_keeps_both_predictions(self, cost):
        handoff, whole = ServingOption(31.0, 0.05, 1.0), ServingOption(1.0, 0.3, 0.5)
        decision = self.policy(cost).choose(handoff, whole)
        assert decision.serving is None and decision.handoff == handoff and decision.whole == whole

    def test_time_waited_for_a_placement_counts_against_the_ttft_slo(self, cost):
        handoff, whole = ServingOption(20.0, 0.05, 1.0), ServingOption(25.0, 0.05, 0.5)
        assert self.policy(cost).choose(handoff, whole).serving is Serving.WHOLE
        assert self.policy(cost).choose(handoff, whole, waited_s=8.0).serving is Serving.HANDOFF
        assert self.policy(cost).choose(handoff, whole, waited_s=12.0).serving is None

    def test_a_migrated_request_takes_the_cheaper_option_when_both_miss(self, cost):
        handoff, whole = ServingOption(31.0, 0.05, 1.0), ServingOption(1.0, 0.3, 0.5)
        assert self.policy(cost).choose(handoff, whole, admitted=True).serving is Serving.WHOLE
        assert self.policy(cost).choose(handoff, None, admitted=True).serving is Serving.HANDOFF
        assert self.policy(cost).choose(None, None, admitted=True).serving is None

    def test_an_option_the_scheduler_rejected_is_not_offered(self, cost):
        policy = self.policy(cost)
        assert policy.choose(None, ServingOption(1.0, 0.05, 9.0)).serving is Serving.WHOLE
        assert policy.choose(None, None).serving is None

    def test_an_idle_instance_qualifies_only_where_the_decode_choice_says_so(self, cost):
        idle_slow = ServingOption(1.0, 0.3, 0.01, idle=True)
        strict = self.policy(cost)
        assert strict.choose(None, idle_slow).serving is None
        lenient = PerRequestDisaggregation(SloAwareDecode(cost.decode, SLOS, idle_qualifies=True), cost, SLOS)
        assert lenient.choose(None, idle_slow).serving is Serving.WHOLE

    def test_a_busy_aggregated_instance_over_the_tbt_slo_hands_off_even_a_short_prompt(self, cost):
        # 60 sequences: 10 + 61 + 30 ms a step, over the 100 ms SLO; the decode instance runs 8
        deployment = Deployment(cost, batch=8, slo=SLOS)
        deployment.aggregated = [decoding("a0", 60, 30_000)]
        assert deployment.serve(2).serving is Serving.HANDOFF

    def test_a_prompt_whose_chunks_would_slow_the_batch_past_the_tbt_slo_is_handed_off_even_when_cheaper(self, cost):
        deployment = Deployment(cost)
        deployment.policy.handoff_overhead_s = 100.0  # the hand-off is dearer than anything
        chosen = deployment.serve(1000)
        # the batch's step with the last 512-token chunk (on top of 488 tokens): 22 ms + 512 ms
        assert chosen.whole.tbt_s == pytest.approx(0.022 + 0.512) and chosen.whole.cost_s < chosen.handoff.cost_s
        assert chosen.serving is Serving.HANDOFF
        assert deployment.serve(40).serving is Serving.WHOLE  # 22 + 40 ms a step

    def test_ties_serve_whole(self, cost):
        option = ServingOption(1.0, 0.05, 0.5)
        assert self.policy(cost).choose(option, option).serving is Serving.WHOLE

    def test_a_negative_overhead_and_an_empty_chunk_are_refused(self, cost):
        with pytest.raises(ValueError, match="handoff_overhead_s"):
            PerRequestDisaggregation(SloAwareDecode(cost.decode), cost, handoff_overhead_s=-1.0)
        with pytest.raises(ValueError, match="chunk_tokens"):
            PerRequestDisaggregation(SloAwareDecode(cost.decode), cost, chunk_tokens=0)
