import pytest

from halfmoon.policy.admission import (
    OVERLOAD_POLL_S,
    EarlyRejection,
    NoAdmission,
    PredictiveEarlyRejection,
    make_admission,
    overload_pause,
)
from halfmoon.policy.cost import DecodeCostModel
from halfmoon.policy.decode import SloAwareDecode
from halfmoon.policy.ledger import Stage, WorkLedger
from halfmoon.policy.prefill import LocalCacheAwarePrefill
from halfmoon.policy.scheduler import KVCentricScheduler
from halfmoon.policy.state import (
    SLO,
    DecodeInstanceState,
    DecodeWork,
    MeasuredStep,
    PrefillInstanceState,
    RouteRequest,
)

SLO_50MS = SLO(ttft_s=30.0, tbt_s=0.050)


def busy(id_: str, batch: int, context: int, ends_at: float = 100.0, capacity: int = 10**6, **kw) -> DecodeInstanceState:
    work = tuple(DecodeWork(context // batch, 0.0, ends_at) for _ in range(batch)) if batch else ()
    return DecodeInstanceState(id_, batch, context, capacity, work=work, **kw)


class TestSloAwareDecode:
    def test_slo_violating_instance_is_avoided(self, cost):
        # a: 10 + 31 + 40 = 81 ms > 50 ms; b: 10 + 6 + 15 = 31 ms.
        decode = SloAwareDecode(cost.decode, SLO_50MS)
        choice = decode.choose([busy("a", 30, 30_000), busy("b", 5, 5_000)], 10_000)
        assert choice is not None and choice.instance_id == "b"
        assert choice.predicted_tbt_s == pytest.approx(0.031)

    def test_least_loaded_first_among_those_within_slo(self, cost):
        decode = SloAwareDecode(cost.decode, SLO_50MS)
        lighter = busy("a", 2, 1_000)
        heavier = busy("b", 10, 10_000)
        assert decode.choose([heavier, lighter], 1_000).instance_id == "a"
        # a recent record of violated TBT marks an instance as loaded even if its batch is small
        flaky = lighter._replace(recent_tbt=(0.2, 0.01))
        assert decode.choose([flaky, heavier], 1_000).instance_id == "b"

    def test_capacity_is_a_hard_limit(self, cost):
        decode = SloAwareDecode(cost.decode, SLO_50MS)
        assert decode.choose([busy("a", 1, 9_000, capacity=10_000)], 2_000) is None
        assert decode.nearest([busy("a", 1, 9_000, capacity=10_000)], 2_000) is None  # no nearest miss to report

    def test_none_when_all_over_slo(self, cost):
        decode = SloAwareDecode(cost.decode, SLO_50MS)
        assert decode.choose([busy("a", 40, 40_000), busy("b", 35, 30_000)], 1_000) is None

    def test_an_idle_instance_qualifies_over_slo_only_when_asked(self, cost):
        # one request of 100,000 context tokens: 10 + 1 + 100 = 111 ms, over 50 ms even alone
        idle, running = busy("a", 0, 0), busy("b", 1, 1_000)
        assert SloAwareDecode(cost.decode, SLO_50MS).choose([idle], 100_000) is None
        lenient = SloAwareDecode(cost.decode, SLO_50MS, idle_qualifies=True)
        assert lenient.choose([idle, running], 100_000).instance_id == "a"
        assert lenient.choose([running], 100_000) is None  # a batch it would slow is still protected
        # judged at a later time: idle then (its work ends at 5) qualifies too
        assert lenient.choose([busy("c", 2, 2_000, ends_at=5.0)], 100_000, at=6.0) is not None

    def test_an_instance_that_interleaves_prefill_is_judged_by_its_shared_steps_too(self, cost):
        # steps that carry a prefill chunk: 100 ms more than the decode alone
        c0, c1, c2 = cost.decode.coef
        shared = DecodeCostModel((c0 + 0.1, c1, c2))
        decode = SloAwareDecode(cost.decode, SLO_50MS, shared_cost=shared)
        disaggregated = busy("d", 5, 5_000)
        aggregated = disaggregated._replace(id="a", interleaves_prefill=True)
        # the decode alone: 10 + 6 + 6 = 22 ms; a chunk in each step while its prompt is computed: 120 ms
        assert decode.predicted_tbt(disaggregated, 1_000) == pytest.approx(0.022)
        assert decode.predicted_tbt(aggregated, 1_000) == pytest.approx(0.010 + 0.1 + 0.005 + 0.006)
        assert decode.choose([aggregated, disaggregated], 1_000).instance_id == "d"
        assert decode.choose([aggregated], 1_000) is None
        # nothing running: no batch to slow down, only this request's own steps count
        assert decode.predicted_tbt(busy("a", 0, 0)._replace(interleaves_prefill=True), 1_000) == pytest.approx(0.012)


    def test_an_aggregated_instance_counts_the_prompt_work_queued_on_it(self):
        """As measured live: a burst of 26 prompts placed in 3 s on an aggregated instance whose recent steps
        took 52 ms; each was predicted 52-59 ms and admitted, and the sequences decoding there got
        140-1,226 ms between tokens while the burst's prompts shared their steps."""
        decode = SloAwareDecode(DecodeCostModel((0.05, 0.0, 0.0)), SLO(ttft_s=30.0, tbt_s=0.2))
        calm = DecodeInstanceState("a0", 4, 0, 10**6, interleaves_prefill=True, queued_prefill_s=1.0)
        burst = calm._replace(queued_prefill_s=6.0)
        # 32 tokens each: 0.05 + 1 / 32 = 0.081 s is within the SLO, 0.05 + 6 / 32 = 0.2375 s is not
        choice = decode.choose([calm], 100, decode_tokens=32)
        assert choice is not None and choice.predicted_tbt_s == pytest.approx(0.05)  # the request's own
        assert decode.choose([burst], 100, decode_tokens=32) is None
        nearest = decode.nearest([burst], 100, decode_tokens=32)
        assert nearest is not None and nearest.predicted_tbt_s == pytest.approx(0.05 + 6.0 / 32)
        assert decode.choose([burst], 100) is not None  # max_tokens not known: its steps alone
        # an instance that computes no prompts is not slowed by any
        assert decode.choose([burst._replace(interleaves_prefill=False)], 100, decode_tokens=32) is not None
        admission = PredictiveEarlyRejection(decode)
        verdict = admission.admit([burst], 100, now=0.0, prefill_done_at=1.0, decode_tokens=32)
        assert not verdict.accepted and verdict.decode is not None
        assert admission.admit([calm], 100, now=0.0, prefill_done_at=1.0, decode_tokens=32).accepted

    def test_an_aggregated_instance_counts_the_request_s_own_prompt_where_it_would_slow_others(self):
        """As measured live: the eleventh request of a burst, a 2,725-token prompt predicted at 8.5 s of prefill,
        was admitted beside ten decoding sequences with 32 tokens each to go, and they got 300 ms between
        tokens while it was computed in their steps."""
        decode = SloAwareDecode(DecodeCostModel((0.05, 0.0, 0.0)), SLO(ttft_s=30.0, tbt_s=0.2))
        decoding = DecodeInstanceState("a0", 10, 0, 10**6, interleaves_prefill=True, queued_prefill_s=1.0)
        # 0.05 + 1 / 32 = 0.081 s with the queued work alone; with its own 8.5 s, 0.05 + 9.5 / 32 = 0.347 s
        assert decode.choose([decoding], 2_725, decode_tokens=32) is not None
        assert decode.choose([decoding], 2_725, decode_tokens=32, prompt_s=8.5) is None
        nearest = decode.nearest([decoding], 2_725, decode_tokens=32, prompt_s=8.5)
        assert nearest is not None and nearest.predicted_tbt_s == pytest.approx(0.05 + 9.5 / 32)
        # what a rejection names: the step, and the prompt work (queued and its own) over the decoders' tokens
        assert nearest.parts is not None
        assert (nearest.parts.step_s, nearest.parts.prompt_work_s, nearest.parts.spread_tokens) == pytest.approx(
            (0.05, 9.5, 32))
        assert nearest.parts.describe() == "step 0.050s + prompt work 9.50s over 32 tokens"
        measured = decoding._replace(measured=MeasuredStep(batch=7.0, context_tokens=0.0, seconds=0.388))
        parts = decode.nearest([measured], 2_725, decode_tokens=32, prompt_s=8.5).parts
        assert parts is not None and parts.describe().endswith("; steps lately 0.388s at batch 7.0")
        assert parts.step_s + parts.prompt_work_s / parts.spread_tokens == pytest.approx(
            decode.nearest([measured], 2_725, decode_tokens=32, prompt_s=8.5).predicted_tbt_s)
        # a short prompt still fits: 0.05 + (1 + 2) / 32 = 0.144 s
        choice = decode.choose([decoding], 300, decode_tokens=32, prompt_s=2.0)
        assert choice is not None and choice.predicted_tbt_s == pytest.approx(0.05)  # the request's own
        # nothing decoding or waiting there: its prompt slows no one
        idle = DecodeInstanceState("a1", 0, 0, 10**6, interleaves_prefill=True)
        assert decode.choose([idle], 2_725, decode_tokens=32, prompt_s=8.5) is not None
        # an instance that computes no prompts is not slowed by this one
        assert decode.choose([decoding._replace(interleaves_prefill=False)], 2_725, decode_tokens=32,
                             prompt_s=8.5) is not None
        # waiting for the queue to drain does not let in a prompt whose own work is too much
        assert decode.clears_in([decoding], 2_725, decode_tokens=32, prompt_s=8.5) is None
        # one whose own work fits waits for the queued work ahead: 0.05 + (1 + 4.5) / 32 - 0.2 over a token
        assert decode.clears_in([decoding], 2_000, decode_tokens=32, prompt_s=4.5) == pytest.approx(
            (0.05 + 5.5 / 32 - 0.2) * 32)
        verdict = PredictiveEarlyRejection(decode).admit([decoding], 2_725, now=0.0, prefill_done_at=9.0,
                                                         decode_tokens=32, prompt_s=8.5)
        assert not verdict.accepted and verdict.clears_in_s is None

    def test_prompt_work_is_spread_over_the_decoding_sequences_tokens_where_known(self):
        """As tried live: a 3,300-token prompt asking for 8 tokens beside six sequences of 300 tokens."""
        decode = SloAwareDecode(DecodeCostModel((0.05, 0.0, 0.0)), SLO(ttft_s=30.0, tbt_s=0.2))
        unknown = DecodeInstanceState("a0", 6, 0, 10**6, interleaves_prefill=True)
        # spread over its own 8 tokens: 0.05 + 5 / 8; over theirs: 0.05 + 5 / 300 = 0.067 s
        assert decode.choose([unknown], 3_300, decode_tokens=8, prompt_s=5.0) is None
        known = unknown._replace(decoders_tokens=300.0)
        assert decode.decoders_tbt(known, 3_300, 8, 5.0) == pytest.approx(0.05 + 5.0 / 300)
        assert decode.choose([known], 3_300, decode_tokens=8, prompt_s=5.0) is not None
        # short decoders feel a long prompt more than the request's own count says
        short = unknown._replace(decoders_tokens=16.0)
        assert decode.choose([short], 3_300, decode_tokens=400, prompt_s=5.0) is None
        assert decode.clears_in([short._replace(queued_prefill_s=2.0)], 300, decode_tokens=400, prompt_s=0.5) == \
            pytest.approx((0.05 + 2.5 / 16 - 0.2) * 16)

    def test_the_pace_of_prompts_measured_lately_and_the_work_queued_now_are_not_counted_twice(self):
        # a step that carries a prompt chunk takes 1 s more; one step in 20 carried one lately
        decode = SloAwareDecode(DecodeCostModel((0.05, 0.0, 0.0)), SLO(ttft_s=30.0, tbt_s=0.12),
                                shared_cost=DecodeCostModel((1.05, 0.0, 0.0)))
        steady = DecodeInstanceState("a0", 4, 0, 10**6, interleaves_prefill=True, shared_step_fraction=0.05,
                                     queued_prefill_s=2.0)
        # its own: 0.05 + 0.05 * 1.0 = 0.1 s; the decoding sequences with 2 s queued and 1 s its own over 64
        # tokens: 0.05 + 3 / 64 = 0.097 s, the slower of the two 0.1 s (summed, 0.147 s: over the SLO)
        assert decode.predicted_tbt(steady, 500) == pytest.approx(0.1)
        assert decode.decoders_tbt(steady, 500, 64, 1.0) == pytest.approx(0.1)
        assert decode.choose([steady], 500, decode_tokens=64, prompt_s=1.0) is not None
        # a burst above that pace: 6 s queued is 0.05 + 7 / 64 = 0.159 s
        burst = steady._replace(queued_prefill_s=6.0)
        assert decode.decoders_tbt(burst, 500, 64, 1.0) == pytest.approx(0.05 + 7.0 / 64)
        assert decode.choose([burst], 500, decode_tokens=64, prompt_s=1.0) is None
        assert decode.clears_in([burst], 500, decode_tokens=64, prompt_s=1.0) == pytest.approx(
            (0.05 + 7.0 / 64 - 0.12) * 64)

    def test_on_one_window_of_both_kinds_of_steps_the_queue_adds_to_the_steps_lately(self):
        """As measured live: taken apart there (the slower of the two), requests admitted into the trace's
        bursts got 300 ms between tokens where the sum kept them at 156 ms; the sequences decoding there have
        seen the pace of the steps lately so far and will see the queue next."""
        decode = SloAwareDecode(DecodeCostModel((0.05, 0.0, 0.0)), SLO(ttft_s=30.0, tbt_s=0.12))
        window = MeasuredStep(batch=4.0, context_tokens=0.0, seconds=0.1)
        steady = DecodeInstanceState("a0", 4, 0, 10**6, interleaves_prefill=True, measured=window,
                                     prompt_excess_s=0.05, queued_prefill_s=2.0)
        assert decode.predicted_tbt(steady, 500) == pytest.approx(0.1)
        assert decode.decoders_tbt(steady, 500, 64, 1.0) == pytest.approx(0.1 + 3.0 / 64)
        assert decode.choose([steady], 500, decode_tokens=64, prompt_s=1.0) is None
        nearest = decode.nearest([steady], 500, decode_tokens=64, prompt_s=1.0)
        assert nearest is not None and nearest.parts is not None and nearest.parts.describe() == (
            "step 0.100s + prompt work 3.00s over 64 tokens; steps lately 0.100s at batch 4.0, 0.050s of it prompts")

    def test_how_long_until_the_queued_prompt_work_lets_a_request_in(self):
        decode = SloAwareDecode(DecodeCostModel((0.05, 0.0, 0.0)), SLO(ttft_s=30.0, tbt_s=0.2))
        burst = DecodeInstanceState("a0", 4, 0, 10**6, interleaves_prefill=True, queued_prefill_s=6.0)
        # 6 s queued over 32 tokens is 0.1375 s too much a token: 4.4 s of it must be computed first
        assert decode.clears_in([burst], 100, decode_tokens=32) == pytest.approx((0.05 + 6.0 / 32 - 0.2) * 32)
        slower = burst._replace(id="a1", queued_prefill_s=5.0)
        assert decode.clears_in([burst, slower], 100, decode_tokens=32) == pytest.approx((0.05 + 5.0 / 32 - 0.2) * 32)
        # its own steps over the SLO, a prompt-free instance, a request of unknown length: no wait lets it in
        over = DecodeInstanceState("s", 4, 0, 10**6, interleaves_prefill=True, queued_prefill_s=6.0, measured=MeasuredStep(4, 0, 0.3))
        assert decode.clears_in([over], 100, decode_tokens=32) is None
        assert decode.clears_in([burst._replace(interleaves_prefill=False)], 100, decode_tokens=32) is None
        assert decode.clears_in([burst], 100) is None
        verdict = PredictiveEarlyRejection(decode).admit([burst], 100, now=0.0, prefill_done_at=1.0, decode_tokens=32)
        assert verdict.clears_in_s == pytest.approx((0.05 + 6.0 / 32 - 0.2) * 32)

    def test_a_request_kept_out_by_the_pace_of_prompts_lately_waits_for_it_to_pass(self):
        """As measured beside a busy loop: steps lately 0.189 s at batch 7.8, 0.085 s of it a wave's prompts,
        and a 512-token prompt's 1.28 s over 64 tokens put the decoding sequences at 0.209 s; the same load
        without admission served those requests at 125-180 ms between tokens."""
        decode = SloAwareDecode(DecodeCostModel((0.05, 0.0, 0.0)), SLO(ttft_s=30.0, tbt_s=0.2))
        window = MeasuredStep(batch=8.0, context_tokens=0.0, seconds=0.189)
        after_wave = DecodeInstanceState("a0", 7, 0, 10**6, interleaves_prefill=True, measured=window,
                                         prompt_excess_s=0.085, decoders_tokens=64.0)
        assert decode.choose([after_wave], 512, decode_tokens=64, prompt_s=1.28) is None
        # the pace passes as its steps leave the window: the wait is the excess as work, a second a second
        over = decode.decoders_tbt(after_wave, 512, 64, 1.28) - 0.2
        assert decode.clears_in([after_wave], 512, decode_tokens=64, prompt_s=1.28) == pytest.approx(over * 64)
        # a level over the SLO without the prompts in it, or a prompt whose own work is too much: no wait
        slow = after_wave._replace(measured=window._replace(seconds=0.3))
        assert decode.clears_in([slow], 512, decode_tokens=64, prompt_s=1.28) is None
        assert decode.clears_in([after_wave], 512, decode_tokens=64, prompt_s=8.0) is None
        # nothing of the level came from prompts: as before, no wait
        assert decode.clears_in([after_wave._replace(prompt_excess_s=0.0)], 512, decode_tokens=64,
                                prompt_s=1.28) is None

    def test_a_request_for_one_token_gives_prompt_work_no_gap_to_lengthen(self):
        """As measured beside a busy loop: as a trace's burst ended, the only decoder the ledger still named
        was a request for one token, the queued prompts were spread over that one token (0.7-3.0 s between
        tokens), and 16 requests waiting for the burst to pass were turned away."""
        decode = SloAwareDecode(DecodeCostModel((0.05, 0.0, 0.0)), SLO(ttft_s=30.0, tbt_s=0.2))
        ledger = WorkLedger()
        ledger.place("one-token", [Stage("a0", 0, 100.0, 0.6, 275), Stage("a0", 1, 150.0, 0.0, 275, 1)], now=0.0)
        assert ledger.outstanding("a0").mean_decode_tokens == 0.0  # no decoder with a gap: none named
        window = MeasuredStep(batch=19.1, context_tokens=0.0, seconds=0.201)
        after_burst = DecodeInstanceState("a0", 1, 0, 10**6, interleaves_prefill=True, measured=window,
                                          queued_prefill_s=0.6, prompt_excess_s=0.089,
                                          decoders_tokens=ledger.outstanding("a0").mean_decode_tokens)
        # a request for 32 tokens: the prompt work spread over its own 32, not over one; it waits, not a 429
        assert decode.decoders_tbt(after_burst, 212, 32, 0.3) == pytest.approx(0.201 + 0.9 / 32)
        wait = decode.clears_in([after_burst], 212, decode_tokens=32, prompt_s=0.3)
        assert wait is not None and wait == pytest.approx((0.201 + 0.9 / 32 - 0.2) * 32)
        # a request for one token beside nothing else that decodes: its step alone decides
        assert decode.decoders_tbt(after_burst, 212, 1, 0.3) == pytest.approx(decode.predicted_tbt(after_burst, 212))
        assert decode.choose([after_burst._replace(measured=window._replace(seconds=0.15))], 212, decode_tokens=1,
                             prompt_s=3.0) is not None
        assert decode.clears_in([after_burst], 212, decode_tokens=1, prompt_s=0.3) is None


class TestAdmission:
    def test_early_rejection_rejects_before_prefill_on_current_overload(self, cost):
        decode = SloAwareDecode(cost.decode, SLO_50MS)
        pool = [busy("a", 40, 40_000, ends_at=12.0)]
        verdict = EarlyRejection(decode).admit(pool, 1_000, now=0.0, prefill_done_at=20.0)
        assert not verdict.accepted and verdict.reason == "decode_overloaded"
        assert verdict.retry_after_s == pytest.approx(12.0)
        assert NoAdmission(decode).admit(pool, 1_000, now=0.0, prefill_done_at=20.0).accepted

    def test_prediction_accepts_when_load_drains_before_prefill_ends(self, cost):
        decode = SloAwareDecode(cost.decode, SLO_50MS)
        pool = [busy("a", 40, 40_000, ends_at=12.0)]
        verdict = PredictiveEarlyRejection(decode).admit(pool, 1_000, now=0.0, prefill_done_at=20.0)
        assert verdict.accepted and verdict.decode.instance_id == "a"
        assert verdict.decode.predicted_tbt_s == pytest.approx(0.012)

    def test_prediction_rejects_overload_arriving_by_then(self, cost):
        decode = SloAwareDecode(cost.decode, SLO_50MS)
        incoming = tuple(DecodeWork(1_000, 5.0, 60.0) for _ in range(40))
        pool = [DecodeInstanceState("a", 0, 0, 10**6, work=incoming)]
        assert EarlyRejection(decode).admit(pool, 1_000, now=0.0, prefill_done_at=20.0).accepted
        verdict = PredictiveEarlyRejection(decode).admit(pool, 1_000, now=0.0, prefill_done_at=20.0)
        assert not verdict.accepted and verdict.reason == "decode_overloaded_predicted"
        # the rejection says how near it came: the instance and its predicted TBT, over the SLO
        assert verdict.decode is not None and verdict.decode.instance_id == "a"
        assert verdict.decode.predicted_tbt_s == pytest.approx(decode.predicted_tbt(pool[0], 1_000, at=20.0))
        assert verdict.decode.predicted_tbt_s > SLO_50MS.tbt_s

    def test_an_overload_expected_to_clear_within_the_wait_is_asked_again_at_most_a_second_apart(self):
        assert overload_pause(None, 0.0, 30.0) is None  # waiting would not let it in
        assert overload_pause(0.02, 0.0, 30.0) == pytest.approx(OVERLOAD_POLL_S[0])
        assert overload_pause(0.4, 0.0, 30.0) == pytest.approx(0.4)
        assert overload_pause(12.0, 0.0, 30.0) == pytest.approx(OVERLOAD_POLL_S[1])
        assert overload_pause(12.0, 17.0, 30.0) == pytest.approx(OVERLOAD_POLL_S[1])
        assert overload_pause(12.0, 18.5, 30.0) is None  # it would clear past the limit
        assert overload_pause(0.02, 29.95, 30.0) is None  # the next ask would be past it
        assert overload_pause(0.4, 0.0, 0.0) is None  # no wait: answered at once

    def test_factory(self, cost):
        decode = SloAwareDecode(cost.decode)
        assert isinstance(make_admission("predictive", decode), PredictiveEarlyRejection)
        with pytest.raises(ValueError):
            make_admission("maybe", decode)


class TestScheduler:
    REQUEST = RouteRequest(tuple(f"k{i}" for i in range(10)), 1000, 100)

    def test_predicted_overload_rejects_before_prefill(self, cost):
        decode = SloAwareDecode(cost.decode, SLO_50MS)
        sched = KVCentricScheduler(LocalCacheAwarePrefill(cost, SLO_50MS), EarlyRejection(decode), SLO_50MS)
        decision = sched.schedule(self.REQUEST, [PrefillInstanceState("p", 0.0)], [busy("d", 40, 40_000)], {}, 0.0)
        assert not decision.accepted and decision.reason == "decode_overloaded"
        assert decision.retry_after_s >= 1.0
        assert decision.decode is not None and decision.decode.predicted_tbt_s > SLO_50MS.tbt_s

    def test_ttft_slo_rejection_with_retry_after(self, cost):
        decode = SloAwareDecode(cost.decode, SLO_50MS)
        sched = KVCentricScheduler(LocalCacheAwarePrefill(cost, SLO_50MS), NoAdmission(decode), SLO_50MS)
        decision = sched.schedule(self.REQUEST, [PrefillInstanceState("p", 40.0)], [busy("d", 1, 100)], {}, 0.0)
        assert not decision.accepted and decision.reason == "ttft_slo"
        assert decision.retry_after_s == pytest.approx(11.0)

    def test_time_waited_for_a_placement_counts_against_the_ttft_slo(self, cost):
        decode = SloAwareDecode(cost.decode, SLO_50MS)
        sched = KVCentricScheduler(LocalCacheAwarePrefill(cost, SLO_50MS), NoAdmission(decode), SLO_50MS)
        fresh = sched.schedule(self.REQUEST, [PrefillInstanceState("p", 20.0)], [busy("d", 1, 100)], {}, 0.0)
        assert fresh.accepted and fresh.prefill.ttft_s < SLO_50MS.ttft_s
        waited = SLO_50MS.ttft_s - fresh.prefill.ttft_s + 3.0
        late = sched.schedule(self.REQUEST._replace(waited_s=waited), [PrefillInstanceState("p", 20.0)],
                              [busy("d", 1, 100)], {}, 0.0)
        assert not late.accepted and late.reason == "ttft_slo"
        assert late.retry_after_s == pytest.approx(3.0)

    def test_a_migrated_request_is_placed_whatever_the_predictions(self, cost):
        """It was admitted once and has streamed: rejected now, it would be lost. The decode instance is the
        nearest miss; with none within SLO it is still the one predicted fastest."""
        decode = SloAwareDecode(cost.decode, SLO_50MS)
        sched = KVCentricScheduler(LocalCacheAwarePrefill(cost, SLO_50MS), PredictiveEarlyRejection(decode), SLO_50MS)
        migrated = self.REQUEST._replace(admitted=True)
        overloaded = [busy("d", 40, 40_000), busy("e", 45, 45_000)]
        assert not sched.schedule(self.REQUEST, [PrefillInstanceState("p", 0.0)], overloaded, {}, 0.0).accepted
        decision = sched.schedule(migrated, [PrefillInstanceState("p", 0.0)], overloaded, {}, 0.0)
        assert decision.accepted and decision.decode is not None and decision.decode.instance_id == "d"
        late = sched.schedule(migrated, [PrefillInstanceState("p", 40.0)], [busy("d", 1, 100)], {}, 0.0)
        assert late.accepted and late.prefill.ttft_s > SLO_50MS.ttft_s

    def test_accepts_with_both_choices(self, cost):
        decode = SloAwareDecode(cost.decode, SLO_50MS)
        sched = KVCentricScheduler(LocalCacheAwarePrefill(cost, SLO_50MS), PredictiveEarlyRejection(decode), SLO_50MS)
        decision = sched.schedule(self.REQUEST, [PrefillInstanceState("p", 0.0)], [busy("d", 1, 100)], {}, 0.0)
        assert decision.accepted and decision.prefill.instance_id == "p" and decision.decode.instance_id == "d"


class TestDecodeLoadSpreads:
    """Instances a flat cost model cannot tell apart share the load (everything went to the first by id)."""

    FLAT = DecodeCostModel((0.01, 0.0, 0.0))

    def spread(self, decode: SloAwareDecode, at: float | None) -> dict[str, int]:
        batches = {"d0": 0, "d1": 0}
        for _ in range(10):
            # a live conductor knows the batch now, not when work ends (work=None)
            states = [DecodeInstanceState(i, n, 0, 10**6) for i, n in batches.items()]
            batches[decode.choose(states, 100, at=at).instance_id] += 1
        return batches

    def test_flat_cost_takes_turns_now_and_predicted(self):
        decode = SloAwareDecode(self.FLAT, SLO_50MS)
        assert self.spread(decode, at=None) == {"d0": 5, "d1": 5}
        assert self.spread(decode, at=20.0) == {"d0": 5, "d1": 5}

    def test_unknown_end_times_stand_for_the_load_now(self):
        state = DecodeInstanceState("d0", 3, 300, 10**6)
        assert state.load_at(50.0) == (3, 300) and state.earliest_end_after(0.0) is None
        assert busy("d1", 0, 0).load_at(50.0) == (0, 0)  # known to be idle


class TestPredictionsStartFromTheInstancesOwnSteps:
    """One cost model serves every instance; each instance's latest steps correct its predictions
    (a model three times too slow rejected requests whose tokens came well within the SLO): a faster one
    scales the model down, a slower one adds its excess to it."""

    MODEL = DecodeCostModel((0.03, 0.015, 0.0))  # 150 ms for 8, where the instance below steps in 50 ms

    def test_an_instance_faster_than_the_model_is_judged_by_its_own_steps(self):
        decode = SloAwareDecode(self.MODEL, SLO(ttft_s=30.0, tbt_s=0.1))
        unmeasured = DecodeInstanceState("d0", 7, 3_500, 10**6)
        measured = unmeasured._replace(measured=MeasuredStep(batch=7, context_tokens=3_500, seconds=0.045))
        assert decode.choose([unmeasured], 500) is None  # 150 ms predicted for 8
        choice = decode.choose([measured], 500)
        assert choice is not None and choice.predicted_tbt_s == pytest.approx(0.045 * 0.15 / 0.135)

    def test_a_slowed_instance_is_judged_slower(self):
        decode = SloAwareDecode(DecodeCostModel((0.01, 0.005, 0.0)), SLO(ttft_s=30.0, tbt_s=0.1))
        state = DecodeInstanceState("d0", 3, 0, 10**6, measured=MeasuredStep(3, 0, 0.075))  # 3x the model
        assert decode.predicted_tbt(state, 100) == pytest.approx(0.075 + 0.005)

    def test_prefill_chunks_are_judged_by_the_steps_they_shared(self):
        decode = SloAwareDecode(DecodeCostModel((0.01, 0.005, 0.0)), SLO(ttft_s=30.0, tbt_s=0.2),
                                shared_cost=DecodeCostModel((0.05, 0.005, 0.0)))
        state = DecodeInstanceState("a0", 2, 0, 10**6, interleaves_prefill=True,
                                    measured=MeasuredStep(2, 0, 0.02), measured_shared=MeasuredStep(2, 0, 0.12))
        # decode-only at batch 3: 0.025 as modelled; with this prompt's chunk at batch 2: 0.06 + (0.12 - 0.06)
        assert decode.predicted_tbt(state, 100) == pytest.approx(0.12)

    def test_rare_slow_prefill_steps_count_by_how_often_they_come(self):
        # One step in 20 carried a prompt chunk and took 6x a decode-only step: a decoding sequence's mean
        # time between tokens is 1.25x the decode-only step, not the chunk's 6x. Judged by the slowest step,
        # every request was refused while the stream delivered within the SLO.
        decode = SloAwareDecode(DecodeCostModel((0.01, 0.005, 0.0)), SLO(ttft_s=30.0, tbt_s=0.05),
                                shared_cost=DecodeCostModel((0.05, 0.005, 0.0)))
        state = DecodeInstanceState("a0", 2, 0, 10**6, interleaves_prefill=True,
                                    measured=MeasuredStep(2, 0, 0.02), measured_shared=MeasuredStep(2, 0, 0.12))
        assert decode.choose([state], 100) is None  # no proportion measured: the chunk's 0.12 s
        rare = state._replace(shared_step_fraction=0.05)
        assert decode.predicted_tbt(rare, 100) == pytest.approx(0.025 + 0.05 * (0.12 - 0.025))
        assert decode.choose([rare], 100) is not None
        assert decode.choose([state._replace(shared_step_fraction=0.5)], 100) is None  # half the steps: 0.07 s

    def test_an_instance_without_steps_takes_its_peers_correction(self):
        # The machine runs 3x slower than the model: judged by the bare model, the idle instance looked
        # 3x faster than the busy one and drew every request until its own steps came in.
        decode = SloAwareDecode(DecodeCostModel((0.01, 0.005, 0.0)), SLO(ttft_s=30.0, tbt_s=1.0))
        busy_one = DecodeInstanceState("d0", 1, 0, 10**6, measured=MeasuredStep(1, 0, 0.045))  # 3x the model
        idle_one = DecodeInstanceState("d1", 0, 0, 10**6)
        assert decode.predicted_tbt(idle_one, 100, peers=[busy_one, idle_one]) == pytest.approx(0.015 + 0.03)
        assert decode.predicted_tbt(idle_one, 100) == pytest.approx(0.015)  # no peer measured: the model
        choice = decode.choose([busy_one, idle_one], 100)
        assert choice is not None and choice.instance_id == "d1"  # still the lighter batch
        # once it holds as much, the two are judged alike, though only one has measured its steps
        as_busy = idle_one._replace(batch_size=1)
        pool = [busy_one, as_busy]
        assert decode.predicted_tbt(as_busy, 100, peers=pool) == pytest.approx(decode.predicted_tbt(busy_one, 100, peers=pool))

    def test_instances_share_the_load_whatever_their_corrections(self):
        # a model flat in the batch, and two instances whose latest steps differ by half (noise on shared
        # cores): weighed by their own steps, the faster one took nearly every request
        decode = SloAwareDecode(DecodeCostModel((0.01, 0.0001, 0.0)), SLO(ttft_s=30.0, tbt_s=0.2))
        fast = DecodeInstanceState("d0", 2, 0, 10**6, measured=MeasuredStep(2, 0, 0.008))
        slow = DecodeInstanceState("d1", 1, 0, 10**6, measured=MeasuredStep(1, 0, 0.012))
        choice = decode.choose([fast, slow], 100)
        assert choice is not None and choice.instance_id == "d1"  # the lighter batch, though slower
        assert choice.predicted_tbt_s == pytest.approx(decode.predicted_tbt(slow, 100))  # reported from its steps

    def test_steps_measured_at_a_small_batch_are_not_multiplied_into_a_large_one(self):
        # A model fitted with no fixed cost (15 ms a sequence) and an instance whose one-sequence steps took
        # 60 ms (mostly fixed cost): as a ratio (4x), carried to a batch of nine, 0.54 s was predicted and
        # the request refused; the model's growth added to what was measured is 0.18 s
        decode = SloAwareDecode(DecodeCostModel((0.0, 0.015, 0.0)), SLO(ttft_s=30.0, tbt_s=0.2))
        state = DecodeInstanceState("d0", 8, 0, 10**6, measured=MeasuredStep(1, 0, 0.06))
        choice = decode.choose([state], 100)
        assert choice is not None and choice.predicted_tbt_s == pytest.approx(0.06 + 8 * 0.015)
