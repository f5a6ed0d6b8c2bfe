import pytest

from halfmoon.policy.state import SLO
from halfmoon.sim.config import SimConfig
from halfmoon.sim.forecast import IntervalLoad
from halfmoon.sim.plan import AGGREGATED, DISAGGREGATED, Candidate, Layout, PlanSettings, simulator
from halfmoon.sim.planner import Scaler, ScalingSettings, forecast_trace
from tests.planner.conftest import TBT_SLO_S

PER_INSTANCE_RPS = 1.0  # the constructed surface: each instance serves 1 req/s within the SLOs


def surface(load: IntervalLoad):
    """Attainment = served / offered with ``PER_INSTANCE_RPS`` per instance (disaggregated: the scarcer role)."""
    def evaluate(layout: Layout) -> Candidate:
        serving = layout.prefill if layout.mode == AGGREGATED else min(layout.prefill, layout.decode)
        attainment = min(1.0, serving * PER_INSTANCE_RPS / load.arrival_rps)
        return Candidate(layout, attainment, 0.0, 0.0, 0.0, 0, attainment >= 0.9, 0.0)

    return evaluate


def settings(mode: str = AGGREGATED, **kw) -> ScalingSettings:
    return ScalingSettings(PlanSettings(SimConfig(), target=0.9, max_instances=8), mode=mode, horizon_s=10.0, **kw)


def load(rps: float) -> IntervalLoad:
    return IntervalLoad(rps, 100.0, 10.0, 0.0)


class TestDecisions:
    def test_scales_up_at_once_to_the_fewest_that_meet(self):
        scaler = Scaler(settings())
        decision = scaler.decide(Layout(AGGREGATED, 1), load(3.5), surface)
        assert decision.action == "up" and decision.target == Layout(AGGREGATED, 4)
        assert "1 aggregated reaches 29%" in decision.reason and "4 aggregated is the fewest" in decision.reason

    def test_scales_down_one_step_at_a_time_after_the_cool_down(self):
        scaler = Scaler(settings(cooldown_intervals=2))
        layout = scaler.decide(Layout(AGGREGATED, 1), load(3.5), surface).target
        steps = []
        for _ in range(12):  # load gone
            decision = scaler.decide(layout, load(0.0), surface)
            if decision.action == "down":
                assert decision.target.prefill == layout.prefill - 1
                steps.append(decision.target.prefill)
            else:
                assert decision.action == "hold"
            layout = decision.target
        assert steps == [3, 2, 1]
        assert layout == Layout(AGGREGATED, 1)

    def test_holds_during_the_cool_down(self):
        scaler = Scaler(settings(cooldown_intervals=3))
        layout = scaler.decide(Layout(AGGREGATED, 1), load(3.5), surface).target
        decision = scaler.decide(layout, load(0.5), surface)
        assert decision.action == "hold" and "cooling down (1/3" in decision.reason

    def test_steady_load_does_not_flap(self):
        # 2.9 req/s needs 3; 2 would carry it were it 2.0: the headroom keeps the layout where it is
        scaler = Scaler(settings(headroom=0.25, cooldown_intervals=0))
        layout, actions = Layout(AGGREGATED, 1), []
        for rps in [2.9, 2.7, 2.9, 2.6, 2.8] * 6:
            decision = scaler.decide(layout, load(rps), surface)
            actions.append(decision.action)
            layout = decision.target
        assert actions[0] == "up" and set(actions[1:]) == {"hold"}
        assert layout == Layout(AGGREGATED, 3)

    def test_down_needs_the_headroom(self):
        scaler = Scaler(settings(headroom=0.25, cooldown_intervals=0))
        assert scaler.decide(Layout(AGGREGATED, 3), load(1.9), surface).action == "hold"  # 2 carry 1.9, not 2.4
        decision = scaler.decide(Layout(AGGREGATED, 3), load(1.5), surface)
        assert decision.action == "down" and decision.target == Layout(AGGREGATED, 2)

    def test_disaggregated_drains_decode_first_and_keeps_one_of_each(self):
        scaler = Scaler(settings(DISAGGREGATED, cooldown_intervals=0))
        layout = Layout(DISAGGREGATED, 2, 2)
        targets = []
        for _ in range(4):
            layout = scaler.decide(layout, load(0.0), surface).target
            targets.append(layout)
        assert targets == [Layout(DISAGGREGATED, 2, 1), Layout(DISAGGREGATED, 1, 1), Layout(DISAGGREGATED, 1, 1),
                           Layout(DISAGGREGATED, 1, 1)]

    def test_past_the_largest_it_scales_to_the_best_there_is(self):
        scaler = Scaler(ScalingSettings(PlanSettings(SimConfig(), target=0.9, max_instances=3), horizon_s=10.0))
        decision = scaler.decide(Layout(AGGREGATED, 1), load(10.0), surface)
        assert decision.action == "up" and decision.target == Layout(AGGREGATED, 3)
        assert "no layout of at most 3 instances meets it" in decision.reason

    def test_no_forecast_holds(self):
        decision = Scaler(settings()).decide(Layout(AGGREGATED, 2), None, surface)
        assert decision.action == "hold" and decision.target == Layout(AGGREGATED, 2)


class TestWithTheSimulator:
    """The same decisions on the simulator's replay, with the capped profile the live test gives the planner."""

    def scaling(self) -> ScalingSettings:
        base = SimConfig(slo=SLO(ttft_s=2.0, tbt_s=TBT_SLO_S), block_size=16)
        return ScalingSettings(PlanSettings(base, target=0.9, max_instances=3), horizon_s=30.0, cooldown_intervals=0)

    def test_forecast_trace_shape(self):
        trace = forecast_trace(IntervalLoad(2.0, 40.0, 16.0, 0.5), 10.0, block_size=16)
        assert len(trace) == 20 and trace[1].arrival_s == pytest.approx(0.5)
        assert all(r.input_length == 40 and len(r.hash_ids) == 3 and r.hash_ids[0] == 0 for r in trace)
        assert len({h for r in trace for h in r.hash_ids}) == 1 + 2 * 20  # one shared block, the rest own

    def test_a_backlog_arrives_first_all_at_once(self):
        trace = forecast_trace(IntervalLoad(2.0, 40.0, 16.0, 0.5), 10.0, block_size=16, backlog=5)
        assert len(trace) == 25 and [r.arrival_s for r in trace[:6]] == [0.0] * 6
        assert trace[6].arrival_s == pytest.approx(0.5)
        assert len({h for r in trace for h in r.hash_ids}) == 1 + 2 * 25  # the waiting ones' prompts are their own

    def test_a_backlog_keeps_the_instances_a_quiet_rate_would_drain(self, capped_profile):
        # the rate has fallen, but the deployment holds requests it has not started: one instance fewer must
        # also work those off, and at this profile's two requests per instance it cannot
        scaling = self.scaling()

        def evaluate_at(forecast: IntervalLoad, backlog: int = 0):
            trace = forecast_trace(forecast, scaling.horizon_s, scaling.plan.base.block_size, backlog)
            return simulator(capped_profile, trace, scaling.plan)

        quiet = IntervalLoad(0.5, 40.0, 16.0, 0.3)
        assert Scaler(scaling).decide(Layout(AGGREGATED, 3), quiet, evaluate_at).action == "down"
        held = Scaler(scaling).decide(Layout(AGGREGATED, 3), quiet, lambda f: evaluate_at(f, 12), backlog=12)
        assert held.action in ("hold", "up") and held.target.prefill >= 3, held.reason
        idle_rate = IntervalLoad(0.0, 40.0, 16.0, 0.3)  # nothing new arrives; what waits still must be served
        busy = Scaler(scaling).decide(Layout(AGGREGATED, 1), idle_rate, lambda f: evaluate_at(f, 12), backlog=12)
        assert busy.action == "up", busy.reason

    def test_scales_up_under_load_and_down_after(self, capped_profile):
        scaling = self.scaling()
        scaler = Scaler(scaling)

        def evaluate_at(forecast: IntervalLoad):
            trace = forecast_trace(forecast, scaling.horizon_s, scaling.plan.base.block_size)
            return simulator(capped_profile, trace, scaling.plan)

        busy, quiet = IntervalLoad(3.0, 40.0, 16.0, 0.3), IntervalLoad(0.5, 40.0, 16.0, 0.3)
        assert scaler.decide(Layout(AGGREGATED, 1), quiet, evaluate_at).action == "hold"
        up = scaler.decide(Layout(AGGREGATED, 1), busy, evaluate_at)
        assert up.action == "up" and up.target.prefill >= 2
        layout = up.target
        for _ in range(4):
            layout = scaler.decide(layout, quiet, evaluate_at).target
        assert layout == Layout(AGGREGATED, 1)
