"""The conductor's predictions: TTFT calibration and the decode cost it learns from reported steps."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from fake_instances import SPEC

from halfmoon.policy.ledger import Outstanding
from halfmoon.protocol import (
    Load,
    RejectReason,
    Role,
    SamplingParams,
    ScheduleRequest,
)
from halfmoon.protocol.registry import StepSample
from halfmoon.services.conductor.placement import (
    Placement,
    Rejection,
    place_pair,
)
from halfmoon.services.conductor.policy_config import PolicySettings, build_placement
from halfmoon.services.conductor.registry import InstanceView

REQUEST = ScheduleRequest(request_id="r", model="m", prompt_len=4, sampling=SamplingParams(), deadline=0.0)


class TestCalibrationSetting:

    def test_off_by_default(self):
        placement = build_placement(PolicySettings()).policy
        placement.adopt(SPEC, "prefill-0")
        assert placement.calibration is None and placement.scheduler.calibration is None

    def test_when_set_the_placement_feeds_the_calibration_its_scheduler_reads(self):
        placement = build_placement(PolicySettings(ttft_calibration_s=120.0)).policy
        placement.adopt(SPEC, "prefill-0")
        assert placement.calibration is not None and placement.scheduler.calibration is placement.calibration
        for i in range(8):
            placement.observe_ttft(0.5 + i * 0.25, 2 * (0.5 + i * 0.25), now=float(i))
        assert placement.scheduler.calibration.correct(1.0, now=8.0) == pytest.approx(2.0)

    def test_a_negative_horizon_is_refused(self):
        with pytest.raises(ValueError, match="ttft_calibration_s"):
            PolicySettings(ttft_calibration_s=-1.0).check_policy()


class TestLearnedDecodeCost:
    """TBT admission judges an instance by the steps decoding instances report (prefill chunks sharing an
    aggregated instance's steps included), not by the configured prior alone."""

    PROMPT = tuple(range(3, 40))
    REQUEST = ScheduleRequest(request_id="r", model="m", prompt_len=len(PROMPT), prompt_token_ids=PROMPT,
                              sampling=SamplingParams(), deadline=0.0)

    def aggregated(self, running: int, used_blocks: int) -> list[InstanceView]:
        load = Load(running=running, total_kv_blocks=1000, free_kv_blocks=1000 - used_blocks)
        return [InstanceView("agg-0", Role.AGGREGATED, "agg-0", load, False)]

    def test_slow_reported_steps_turn_requests_away_and_a_small_batch_still_gets_them(self):
        built = build_placement(PolicySettings(tbt_slo_s=0.25))
        built.policy.adopt(SPEC, "agg-0")
        busy = self.aggregated(running=4, used_blocks=100)
        assert isinstance(place_pair(built.policy, self.REQUEST, [], [], busy, now=0.0), Placement)  # prior: 12 ms
        assert built.decode_cost is not None
        for batch in range(1, 9):  # as an AVX2 CPU ran them: about 50 ms per sequence with chunks interleaved
            for kv_tokens in (500, 4000):
                built.decode_cost.record(batch, kv_tokens, 0.02 + 0.05 * batch + 1e-6 * kv_tokens)
        refused = place_pair(built.policy, self.REQUEST, [], [], busy, now=0.0)
        assert isinstance(refused, Rejection) and refused.reason is RejectReason.OVERLOADED, refused
        assert "decode" in refused.message and refused.retry_after_s is not None and refused.retry_after_s >= 1
        # five sequences predicted 0.27 s a step, over the 0.25 s SLO; two are 0.12 s
        quiet = self.aggregated(running=1, used_blocks=10)
        assert isinstance(place_pair(built.policy, self.REQUEST, [], [], quiet, now=0.0), Placement)

    def test_a_heartbeat_behind_the_ledger_does_not_multiply_the_queued_prompt_work(self):
        """As measured (aiperf, 8 streams beside a busy loop): a wave of 8 streams ended together, the last
        heartbeat still said 8 running, and the one prompt placed since counted eight times."""
        built = build_placement(PolicySettings(admission="none"))  # the predicted TTFT is what is read
        built.policy.adopt(SPEC, "agg-0")
        one_prompt = Outstanding(count=2, work_s=1.0, tokens=512, requests=1)
        stale = [v._replace(outstanding=one_prompt) for v in self.aggregated(running=8, used_blocks=100)]
        placement = place_pair(built.policy, self.REQUEST, [], [], stale, now=0.0)
        assert isinstance(placement, Placement) and 1000 <= placement.predicted_ttft_ms < 2000, placement
        # four reported waiting where the ledger holds one (placed before this conductor took over): four prompts
        waiting = [v._replace(load=msgspec.structs.replace(v.load, queue_len=4)) for v in stale]
        placement = place_pair(built.policy, self.REQUEST, [], [], waiting, now=0.0)
        assert isinstance(placement, Placement) and 4000 <= placement.predicted_ttft_ms < 5000, placement

    def test_the_instances_own_latest_steps_set_the_scale(self):
        # the model, soured by a slow spell, says 0.27 s a step for five; the instance's heartbeat says its
        # four sequences step in 40 ms now, so five are predicted near 50 ms and the request is placed
        built = build_placement(PolicySettings(tbt_slo_s=0.25))
        built.policy.adopt(SPEC, "agg-0")
        assert built.decode_cost is not None
        for batch in range(1, 9):
            for kv_tokens in (500, 4000):
                built.decode_cost.record(batch, kv_tokens, 0.02 + 0.05 * batch + 1e-6 * kv_tokens)
        view = self.aggregated(running=4, used_blocks=100)[0]
        assert isinstance(place_pair(built.policy, self.REQUEST, [], [], [view], now=0.0), Rejection)
        measured = view._replace(load=msgspec.structs.replace(
            view.load, steps=StepSample(steps=20, batch=4, kv_tokens=1600, seconds=0.04)))
        placed = place_pair(built.policy, self.REQUEST, [], [], [measured], now=0.0)
        assert isinstance(placed, Placement), placed
        assert placed.predicted_tbt_ms is not None and 40 < placed.predicted_tbt_ms < 60

    def test_predictions_start_from_the_window_not_from_one_heartbeats_steps(self):
        # the last heartbeat's steps were one step a 2,048-token prompt chunk shared (6 s); over the window its
        # decoding sequences saw 0.2 s between tokens, and that is what the request is judged by
        built = build_placement(PolicySettings(tbt_slo_s=0.25))
        built.policy.adopt(SPEC, "agg-0")
        view = self.aggregated(running=4, used_blocks=100)[0]
        spike = StepSample(steps=1, batch=4, kv_tokens=1600, seconds=6.0)
        one_beat = view._replace(load=msgspec.structs.replace(view.load, shared_steps=spike))
        assert isinstance(place_pair(built.policy, self.REQUEST, [], [], [one_beat], now=0.0), Rejection)
        window = StepSample(steps=60, batch=4, kv_tokens=1600, seconds=0.2)
        windowed = one_beat._replace(load=msgspec.structs.replace(one_beat.load, window_steps=window))
        placed = place_pair(built.policy, self.REQUEST, [], [], [windowed], now=0.0)
        assert isinstance(placed, Placement), placed
        assert placed.predicted_tbt_ms is not None and 200 <= placed.predicted_tbt_ms < 250

    def test_least_loaded_placement_learns_nothing_and_learning_decode_can_be_off(self):
        built = build_placement(PolicySettings(placement="least-loaded"))
        assert built.prefill_cost is None and built.decode_cost is None
        assert build_placement(PolicySettings(learn_decode_cost=False)).decode_cost is None

    def test_an_idle_instance_is_never_refused_for_tbt(self):
        # a slow spell (a CPU hog beside the engine) soured the model: even one sequence is over the SLO
        built = build_placement(PolicySettings(tbt_slo_s=0.25))
        built.policy.adopt(SPEC, "agg-0")
        assert built.decode_cost is not None
        for batch in range(1, 9):
            for kv_tokens in (500, 4000):
                built.decode_cost.record(batch, kv_tokens, 0.3 + 0.05 * batch)
        assert isinstance(place_pair(built.policy, self.REQUEST, [], [], self.aggregated(1, 10), now=0.0), Rejection)
        # refusing the idle instance too would stop the steps that can correct the model
        assert isinstance(place_pair(built.policy, self.REQUEST, [], [], self.aggregated(0, 0), now=0.0), Placement)

    def test_with_prefill_interference_steps_a_chunk_shared_judge_aggregated_instances(self):
        built = build_placement(PolicySettings(tbt_slo_s=0.25, prefill_interference=True))
        built.policy.adopt(SPEC, "agg-0")
        assert built.decode_cost is not None and built.shared_cost is not None
        for batch in range(1, 9):  # decoding alone is fast; a step carrying a prompt's chunk is not
            for kv_tokens in (500, 4000):
                built.decode_cost.record(batch, kv_tokens, 0.02 + 0.01 * batch)
                built.shared_cost.record(batch, kv_tokens, 0.3 + 0.01 * batch)
        busy = self.aggregated(running=2, used_blocks=20)
        refused = place_pair(built.policy, self.REQUEST, [], [], busy, now=0.0)
        assert isinstance(refused, Rejection) and "decode" in refused.message, refused
        assert isinstance(place_pair(built.policy, self.REQUEST, [], [], self.aggregated(0, 0), now=0.0), Placement)
        # a decode instance is never judged by chunks it does not run
        decode_view = [busy[0]._replace(instance_id="d0", role=Role.DECODE)]
        prefill_view = [InstanceView("p0", Role.PREFILL, "p0", Load(), False)]
        built.policy.adopt(SPEC, "p0")
        assert isinstance(place_pair(built.policy, self.REQUEST, prefill_view, decode_view, [], now=0.0), Placement)


class TestPacedPrompt:
    """As on the Mooncake trace (aiperf, 2-core EPYC): a 2,725-token prompt beside eight decoding sequences
    with 32 tokens to go, 9.3 s of prefill at 3.4 ms a token, was turned away to protect them; the same load
    without admission served it within both SLOs. An instance whose engine paces prompts takes it paced."""

    PROMPT = tuple(range(3, 2_728))
    REQUEST = ScheduleRequest(request_id="r", model="m", prompt_len=len(PROMPT), prompt_token_ids=PROMPT,
                              sampling=SamplingParams(max_tokens=32), deadline=0.0)

    def placement(self):
        built = build_placement(PolicySettings(tbt_slo_s=0.2))
        built.policy.adopt(SPEC, "agg-0")
        assert built.prefill_cost is not None
        for new in (256, 512, 1024, 2048, 4096):
            built.prefill_cost.record(new, 0, 0.0034 * new)
        return built.policy

    def view(self, paces_prompts: bool) -> InstanceView:
        load = Load(running=8, total_kv_blocks=1000, free_kv_blocks=900,
                    window_steps=StepSample(steps=60, batch=8, kv_tokens=1600, seconds=0.066))
        decoding = Outstanding(count=8, requests=8, decode_tokens=8 * 32, decoders=8)
        return InstanceView("agg-0", Role.AGGREGATED, "agg-0", load, None, outstanding=decoding,
                            paces_prompts=paces_prompts)

    def test_an_engine_that_paces_takes_the_prompt_paced_and_its_ttft_says_so(self):
        refused = place_pair(self.placement(), self.REQUEST, [], [], [self.view(False)], now=0.0)
        assert isinstance(refused, Rejection) and "prompt work 9.26s over 32 tokens" in refused.message, refused
        placed = place_pair(self.placement(), self.REQUEST, [], [], [self.view(True)], now=0.0)
        assert isinstance(placed, Placement), placed
        assert placed.step_target_s == pytest.approx(0.75 * 0.2)
        assert placed.prefill_s == pytest.approx(0.0034 * len(self.PROMPT))  # the work its ledger entry holds
        # each 0.15 s step leaves the prompt what the 0.067 s decoding step does not: 9.26 s over about 16.6 s
        assert placed.predicted_ttft_ms == pytest.approx(placed.model_ttft_ms)
        assert 16_000 < placed.predicted_ttft_ms < 17_000

    def test_beside_a_pair_that_cannot_take_it_the_aggregated_instance_serves_it_whole_paced(self):
        policy = self.placement()
        policy.adopt(SPEC, "p0")
        prefill = [InstanceView("p0", Role.PREFILL, "p0", Load(), False)]
        full = [InstanceView("d0", Role.DECODE, "d0", Load(running=8, total_kv_blocks=1000, free_kv_blocks=0), None)]
        refused = place_pair(policy, self.REQUEST, prefill, full, [self.view(False)], now=0.0)
        assert isinstance(refused, Rejection), refused
        placed = place_pair(policy, self.REQUEST, prefill, full, [self.view(True)], now=0.0)
        assert isinstance(placed, Placement), placed
        assert placed.prefill == placed.decode == "agg-0" and placed.step_target_s == pytest.approx(0.75 * 0.2)
        assert placed.predicted_tbt_ms == pytest.approx(0.75 * 0.2 * 1000)
        assert 16_000 < placed.predicted_ttft_ms < 17_000  # its paced prefill, counted once

    def test_the_prompt_after_a_paced_one_is_neither_queued_behind_it_nor_kept_out_by_it(self):
        """The trace's case: a paced prompt of 4.6 s placed 13 ms before the 2,725-token one, whole in the queue,
        put its decoders at 0.072 + 4.6 / 32 = 0.216 s and that prompt was turned away."""
        paced = Outstanding(count=10, work_s=4.6, tokens=1_350, requests=9, decode_tokens=9 * 32, decoders=9,
                            paced_work_s=4.6)
        view = self.view(True)._replace(outstanding=paced)
        placed = place_pair(self.placement(), self.REQUEST, [], [], [view], now=0.0)
        assert isinstance(placed, Placement) and placed.step_target_s > 0, placed
        # no queue ahead of it: its TTFT is its own paced prefill, as it was with nothing placed before it
        alone = place_pair(self.placement(), self.REQUEST, [], [], [self.view(True)], now=0.0)
        assert isinstance(alone, Placement)
        assert placed.predicted_ttft_ms == pytest.approx(alone.predicted_ttft_ms, rel=0.02)
        # the same work placed unpaced is a queue, and spread whole it keeps the prompt out
        unpaced = view._replace(outstanding=dataclasses.replace(paced, paced_work_s=0.0))
        assert isinstance(place_pair(self.placement(), self.REQUEST, [], [], [unpaced], now=0.0), Rejection)
