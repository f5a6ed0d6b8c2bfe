"""Chunked pipeline-parallel prefill: the pipeline's timing, the Conductor's choice, and the
simulator running it (including on the real conversation trace's longest prompts)."""

from __future__ import annotations

import json

import pytest

from halfmoon.policy.admission import make_admission
from halfmoon.policy.cost import (
    CostModels,
    DecodeCostModel,
    PrefillCostModel,
    TransferModel,
)
from halfmoon.policy.cpp import CppPolicy, CppSettings, pipeline_seconds
from halfmoon.policy.decode import SloAwareDecode
from halfmoon.policy.prefill import PrefillChoice, make_prefill_policy
from halfmoon.policy.scheduler import KVCentricScheduler
from halfmoon.policy.state import SLO, PrefillInstanceState, RouteRequest
from halfmoon.sim.config import SimConfig, SimConfigError
from halfmoon.sim.run import simulate
from halfmoon.sim.trace import TraceRequest
from tests.sim.test_sim_cli import TRACE, parse

# 1 ms per new token, no fixed cost, no attention term; hops: 10 ms + bytes at 1 GB/s
LINEAR = CostModels(PrefillCostModel((0.0, 1e-3, 0.0, 0.0)), DecodeCostModel((0.01, 0.0, 0.0)),
                    TransferModel(1000.0, 1e9, 0.01))


def idle(n: int, queue: float = 0.0) -> list[PrefillInstanceState]:
    return [PrefillInstanceState(f"p{i}", queue) for i in range(n)]


def single(cost: CostModels, tokens: int, node: str = "p0", queue: float = 0.0) -> PrefillChoice:
    prefill = cost.prefill.predict(tokens, 0)
    return PrefillChoice(node, queue + prefill, queue, prefill, 0.0, 0)


class TestPipelineTiming:
    def test_chunks_flow_stage_by_stage(self) -> None:
        # 4 chunks of 1000 tokens, 2 stages: 0.5 s per chunk per stage, hops of 10 ms (no hidden-state bytes)
        # stage 0 ends chunks at 0.5, 1.0, 1.5, 2.0; stage 1 gets each 10 ms later and is never the bottleneck
        assert pipeline_seconds(LINEAR, 4000, 0, 2, 1000, 0) == pytest.approx(2.51)

    def test_hidden_state_bytes_lengthen_every_hop(self) -> None:
        with_bytes = pipeline_seconds(LINEAR, 4000, 0, 2, 1000, 1_000_000)  # 1 GB a chunk: +1 s a hop
        assert with_bytes == pytest.approx(2.51 + 1.0)

    def test_more_stages_cut_a_long_prompt_toward_one_kth(self, profile) -> None:
        one = profile.cost.prefill.predict(110_000, 0)
        times = [pipeline_seconds(profile.cost, 110_000, 0, k, 4096, 16384) for k in (2, 4, 8)]
        assert times == sorted(times, reverse=True)
        assert all(one / k < t < one for k, t in zip((2, 4, 8), times))
        assert one > 30.0 > times[1]  # no single node makes the 30 s SLO; a 4-stage pipeline does


class TestCppPolicy:
    def test_a_long_prompt_on_an_idle_pool_is_pipelined_from_the_chosen_node(self) -> None:
        policy = CppPolicy(LINEAR, CppSettings(stages=3, chunk_tokens=1000, min_tokens=2000))
        choice = single(LINEAR, 6000, node="p2")
        plan = policy.plan(6000, 0, choice, idle(5))
        assert plan is not None and plan.stages[0] == "p2" and len(set(plan.stages)) == 3
        assert plan.ttft_s == pytest.approx(pipeline_seconds(LINEAR, 6000, 0, 3, 1000, 16384))
        assert plan.gain_s == pytest.approx(choice.ttft_s - plan.ttft_s) and plan.gain_s > 0

    def test_short_prompts_small_pools_and_busy_stages_stay_on_one_node(self) -> None:
        policy = CppPolicy(LINEAR, CppSettings(stages=3, chunk_tokens=1000, min_tokens=2000))
        assert policy.plan(1999, 0, single(LINEAR, 1999), idle(5)) is None
        assert policy.plan(6000, 0, single(LINEAR, 6000), idle(2)) is None
        busy = [PrefillInstanceState("p0", 0.0), *idle(4, queue=10.0)[1:]]
        assert policy.plan(6000, 0, single(LINEAR, 6000), busy) is None  # waiting for stages costs more

    def test_rescue_only_pipelines_what_one_node_cannot_do_in_time(self) -> None:
        policy = CppPolicy(LINEAR, CppSettings(stages=3, chunk_tokens=1000, min_tokens=2000, min_single_ttft_s=7.0))
        assert policy.plan(6000, 0, single(LINEAR, 6000), idle(5)) is None  # 6 s alone is fast enough
        assert policy.plan(8000, 0, single(LINEAR, 8000), idle(5)) is not None

    def test_invalid_settings_are_refused(self) -> None:
        with pytest.raises(ValueError):
            CppPolicy(LINEAR, CppSettings(stages=1))


class TestSchedulerWithCpp:
    def scheduler(self, profile, cpp: CppPolicy | None) -> KVCentricScheduler:
        slo = SLO()
        decode = SloAwareDecode(profile.cost.decode, slo)
        return KVCentricScheduler(make_prefill_policy("load-balancing", profile.cost, slo),
                                  make_admission("none", decode), slo, cpp)

    def test_a_prompt_no_node_can_serve_in_time_is_admitted_on_a_pipeline(self, profile) -> None:
        request = RouteRequest(tuple(range(220)), 112_000, 512)
        without = self.scheduler(profile, None).schedule(request, idle(8), [], {}, 0.0)
        assert not without.accepted and without.reason == "ttft_slo" and without.pipeline is None
        with_cpp = self.scheduler(profile, CppPolicy(profile.cost)).schedule(request, idle(8), [], {}, 0.0)
        assert with_cpp.accepted and with_cpp.pipeline is not None
        assert with_cpp.prefill.ttft_s == with_cpp.pipeline.ttft_s < SLO().ttft_s


def long_and_short(gap_s: float = 0.5) -> list[TraceRequest]:
    return [TraceRequest(0.0, 112_000, 10, tuple(range(219))),
            TraceRequest(gap_s, 2_000, 10, tuple(range(1000, 1003)))]


class TestSimulatedCpp:
    def test_without_cpp_the_long_prompt_is_rejected_with_it_served(self, profile) -> None:
        base = SimConfig(prefill_nodes=4, decode_nodes=2)
        off = simulate(base, profile, long_and_short())
        on = simulate(SimConfig(prefill_nodes=4, decode_nodes=2, cpp_stages=4), profile, long_and_short())
        assert (off.summary.rejected_early, off.pipelined) == (1, 0)
        assert (on.summary.completed, on.pipelined) == (2, 1)
        assert on.outcomes.ttft[0] < 30.0

    def test_a_pipeline_holds_all_its_stages(self, profile) -> None:
        # two stages of four: the short request still finds a free node; four of four: it waits
        two = simulate(SimConfig(prefill_nodes=4, decode_nodes=2, cpp_stages=2), profile, long_and_short())
        four = simulate(SimConfig(prefill_nodes=4, decode_nodes=2, cpp_stages=4), profile, long_and_short())
        alone = profile.cost.prefill.predict(2_000, 0)
        assert two.outcomes.ttft[1] == pytest.approx(alone, rel=0.05)
        assert four.outcomes.ttft[1] > four.outcomes.ttft[0] - 0.5

    def test_config_checks(self) -> None:
        with pytest.raises(SimConfigError):
            SimConfig(prefill_nodes=4, cpp_stages=5)
        with pytest.raises(SimConfigError):
            SimConfig(mode="coupled", prefill_nodes=4, decode_nodes=0, cpp_stages=2)


class TestCppOnTheConversationTrace:
    def test_the_longest_prompts_are_served_with_cpp(self, conversation, profile) -> None:
        # the trace's prompts no single node can prefill in 30 s, replayed alone and far apart
        long = [r for r in conversation if profile.cost.prefill.predict(r.input_length, 0) > 30.0][:6]
        spaced = [r._replace(arrival_s=60.0 * i) for i, r in enumerate(long)]
        off = simulate(SimConfig(prefill_nodes=8, decode_nodes=8), profile, spaced)
        on = simulate(SimConfig(prefill_nodes=8, decode_nodes=8, cpp_stages=4), profile, spaced)
        assert len(long) == 6 and off.summary.completed == 0
        # once served, a conversation's next long turn may reuse enough KV to fit one node again
        assert on.summary.completed == 6 and 0 < on.pipelined <= 6 and on.summary.ttft_p99 < 30.0


class TestCppFlag:
    def test_cpp_flag_reaches_the_config_and_the_summary(self, tmp_path) -> None:
        out = tmp_path / "summary.json"
        args = parse(["--trace", str(TRACE), "--limit", "200", "--cpp", "2", "--cpp-min-tokens", "8192",
                      "--cpp-when-slower-than", "0.5", "--json", str(out)])
        assert args.func(args) == 0
        summary = json.loads(out.read_text())
        assert summary["config"]["cpp_stages"] == 2 and summary["config"]["cpp_min_single_ttft_s"] == 0.5
        assert summary["pipelined"] > 0 and summary["requests"] == 200

    def test_bad_stage_count_is_a_clean_error(self, capsys) -> None:
        args = parse(["--trace", str(TRACE), "--limit", "10", "--cpp", "1"])
        assert args.func(args) == 2
        assert "cpp_stages" in capsys.readouterr().out
