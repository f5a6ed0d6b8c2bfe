"""Small simulator runs on a slice of the real conversation trace, checking invariants."""

import dataclasses

import numpy as np
import pytest

from halfmoon.policy.state import SLO, DecodeInstanceState, MeasuredStep
from halfmoon.policy.step_window import step_pace
from halfmoon.sim.config import SimConfig
from halfmoon.sim.coupled import CoupledSim
from halfmoon.sim.metrics import OK, REJECTED_EARLY, REJECTED_LATE
from halfmoon.sim.run import max_sustainable_scale, simulate

SLICE = slice(0, 3000)


def accounted(result) -> None:
    out = result.outcomes
    s = result.summary
    assert s.completed + s.rejected_early + s.rejected_late == len(out)
    ok = out.status == OK
    assert not np.isnan(out.ttft[ok]).any() and not np.isnan(out.tbt[ok]).any()
    assert (out.ttft[ok] >= 0).all() and (out.tbt[ok] >= 0).all()
    assert np.isnan(out.ttft[out.status == REJECTED_EARLY]).all()
    assert (out.finished[ok] >= out.arrival[ok] + out.ttft[ok] - 1e-9).all()
    assert (out.hit_blocks <= out.blocks).all()


class TestDisaggregatedReplay:
    def test_every_request_is_accounted_for_and_caching_hits(self, conversation, profile):
        result = simulate(SimConfig(), profile, conversation[SLICE])
        accounted(result)
        assert result.summary.completed > 0.95 * len(conversation[SLICE])
        assert 0.2 < result.summary.hit_rate < 0.6
        assert result.replicas and result.replicas[0].peak_replicas >= 2  # hot prefix replicated

    def test_no_pool_means_no_hits(self, conversation, profile):
        result = simulate(SimConfig(pool_blocks=0), profile, conversation[SLICE])
        accounted(result)
        assert result.summary.hit_rate == 0.0 and result.pulled_blocks == 0

    def test_global_cache_aware_beats_random_on_ttft(self, conversation, profile):
        ttft = {
            policy: simulate(SimConfig(prefill_policy=policy), profile, conversation[SLICE]).summary.ttft_mean
            for policy in ("random", "global-cache-aware")
        }
        assert ttft["global-cache-aware"] <= ttft["random"]


class TestCoupledReplay:
    @pytest.mark.parametrize("variant", ["plain", "chunked"])
    def test_no_prefix_cache_no_hits(self, conversation, profile, variant):
        result = simulate(SimConfig(mode="coupled", coupled_variant=variant), profile, conversation[SLICE])
        accounted(result)
        assert result.summary.hit_rate == 0.0 and result.summary.completed == len(conversation[SLICE])

    def test_prefix_variant_hits_and_stalls_decode_less_than_plain(self, conversation, profile):
        runs = {
            v: simulate(SimConfig(mode="coupled", coupled_variant=v, coupled_router="local-cache-aware"), profile, conversation[SLICE])
            for v in ("plain", "prefix")
        }
        accounted(runs["prefix"])
        assert runs["prefix"].summary.hit_rate > 0
        assert runs["prefix"].summary.prefill_s_mean < runs["plain"].summary.prefill_s_mean


class TestOverload:
    def test_early_rejection_saves_the_prefill_that_late_rejection_wastes(self, conversation, profile):
        cramped = dataclasses.replace(profile, decode_capacity_tokens=150_000)
        runs = {
            adm: simulate(SimConfig(admission=adm, prefill_nodes=4, decode_nodes=2, time_scale=2.0), cramped, conversation[:2000])
            for adm in ("none", "early", "predictive")
        }
        for run in runs.values():
            accounted(run)
        none, early, predictive = runs["none"], runs["early"], runs["predictive"]
        assert none.summary.rejected_late > 0 and none.wasted_prefill_s > 0
        assert early.summary.rejected_early > none.summary.rejected_early
        assert early.wasted_prefill_s < none.wasted_prefill_s
        assert predictive.wasted_prefill_s < none.wasted_prefill_s
        assert (early.outcomes.status == REJECTED_LATE).sum() < (none.outcomes.status == REJECTED_LATE).sum()

    def test_aggregated_nodes_under_admission_wait_out_an_overload_as_the_gateway_does(self, conversation, profile):
        """The live default layout: aggregated instances only, the Conductor admitting. A request the
        conductor expects to let in soon asks again (the gateway's rule), its wait part of its TTFT and never
        past the TTFT SLO; answered at once instead, more are turned away."""
        base = SimConfig(mode="coupled", coupled_variant="chunked", prefill_nodes=6, decode_nodes=0,
                         admission="predictive", slo=SLO(30.0, 0.1))
        runs = {wait: simulate(dataclasses.replace(base, overload_wait_s=wait), profile, conversation[:2000])
                for wait in (0.0, base.overload_wait_s)}
        at_once, waiting = runs[0.0], runs[base.overload_wait_s]
        for run in runs.values():
            accounted(run)
        assert at_once.summary.waited == 0 and at_once.summary.rejected_early > 0
        assert waiting.summary.waited > 0
        assert waiting.summary.rejected_early < at_once.summary.rejected_early
        out = waiting.outcomes
        waited = out.waited > 0
        assert (out.waited <= base.slo.ttft_s).all()
        served = waited & (out.status == OK)
        assert served.any() and (out.ttft[served] >= out.waited[served]).all()

    def test_aggregated_nodes_are_judged_as_a_live_conductor_judges_aggregated_instances(self, conversation, profile):
        """Each node's state carries the pace of the steps it closed lately (the live heartbeat's rule) and the
        tokens its decoders spread prompt work over, and its prompts are priced by a prefill model learned from
        each prompt's share of the steps it ran in, which also decoded the node's batch. Priced by the
        profile's prefill model alone, admitted requests got 1.67x their predicted TTFT at the median, and more
        than half of them passed the TTFT SLO they were admitted to."""
        seen: list[DecodeInstanceState] = []

        class Recorded(CoupledSim):
            def _decode_state(self, node):
                state = super()._decode_state(node)
                pace = step_pace(tuple(node.batch.steps), self.now)
                assert state.measured == (None if pace is None else MeasuredStep(pace.batch, pace.kv_tokens,
                                                                                 pace.seconds))
                seen.append(state)
                return state

        config = SimConfig(mode="coupled", coupled_variant="chunked", prefill_nodes=6, decode_nodes=0,
                           admission="predictive", slo=SLO(30.0, 0.2))
        sim = Recorded(config, profile, conversation[:2000])
        out = sim.run().outcomes
        assert any(s.prompt_excess_s > 0 for s in seen) and any(s.decoders_tokens > 1 for s in seen)
        assert sim.prefill_fitter is not None
        assert sim.prefill_fitter.predict(2000, 0) > 1.2 * profile.cost.prefill.predict(2000, 0)
        served = out.status == OK
        assert served.sum() > 0.9 * len(out)
        assert (out.ttft[served] > config.slo.ttft_s).sum() <= 0.01 * served.sum()

    def test_sustainable_scale_search_brackets_the_target(self, conversation, profile):
        seen: list[tuple[float, float]] = []
        scale = max_sustainable_scale(
            SimConfig(prefill_nodes=2, decode_nodes=2), profile, conversation[:800], 0.1,
            low=0.25, high=8.0, steps=3, on_run=lambda s, share: seen.append((s, share)),
        )
        assert 0.25 <= scale < 8.0
        assert all(share >= 0.9 for s, share in seen if s <= scale)
        assert any(share < 0.9 for s, share in seen if s > scale)


class TestCacheOnlyReplay:
    def test_unbounded_cache_reaches_the_traces_published_reuse(self, conversation):
        from halfmoon.sim.replay import cache_hit_rate

        # the trace's README: 182,790 distinct blocks among 288,500 references (36.6% reuse)
        assert cache_hit_rate(conversation, None, "lru") == pytest.approx(1 - 182_790 / 288_500, abs=0.005)
        assert cache_hit_rate(conversation[:3000], 500, "lru") < cache_hit_rate(conversation[:3000], None, "lru")
