"""What an engine instance's heartbeat says about its steps: the decode cost models' samples."""

from __future__ import annotations

import pytest

from halfmoon.engine.interface import EngineStats, StepTiming
from halfmoon.policy.step_window import PACE_GAPS, StepPace
from halfmoon.runtime.load_meter import LoadMeter


def step(seconds: float, outputs: int, decoding: int, kv_blocks: int, tokens: int) -> StepTiming:
    return StepTiming(ended=0.0, seconds=seconds, num_outputs=outputs, num_decoding=decoding, kv_blocks=kv_blocks,
                      num_tokens=tokens)


class TestStepSamples:
    def test_decoding_steps_since_the_last_heartbeat_are_averaged_once(self):
        meter = LoadMeter(block_size=16)
        assert meter.take_steps() == (None, None)  # nothing ran yet
        meter.on_step(step(0.10, outputs=2, decoding=2, kv_blocks=10, tokens=2))
        meter.on_step(step(0.50, outputs=0, decoding=0, kv_blocks=40, tokens=512))  # a prefill chunk alone
        meter.on_step(step(0.40, outputs=1, decoding=0, kv_blocks=41, tokens=100))  # a first token alone
        meter.on_step(step(0.30, outputs=4, decoding=4, kv_blocks=30, tokens=4))
        alone, shared = meter.take_steps()
        assert shared is None and alone is not None and alone.steps == 2
        assert (alone.batch, alone.kv_tokens, alone.seconds) == pytest.approx((3.0, 20 * 16, 0.2))
        assert meter.take_steps() == (None, None)  # each step is reported in one heartbeat only

    def test_steps_a_prefill_chunk_shared_are_reported_apart(self):
        meter = LoadMeter(block_size=16)
        meter.on_step(step(0.05, outputs=3, decoding=3, kv_blocks=12, tokens=3))
        # three decoding and a 256-token chunk of another prompt (its last: a first token too)
        meter.on_step(step(0.45, outputs=4, decoding=3, kv_blocks=30, tokens=259))
        meter.on_step(step(0.35, outputs=3, decoding=3, kv_blocks=20, tokens=259))
        alone, shared = meter.take_steps()
        assert alone is not None and (alone.steps, alone.seconds) == (1, pytest.approx(0.05))
        assert shared is not None and shared.steps == 2
        assert (shared.batch, shared.kv_tokens, shared.seconds) == pytest.approx((3.0, 25 * 16, 0.4))


class TestWindowSteps:
    """What TBT predictions start from: the window's decoding steps, as the gaps a decoding sequence saw."""

    @staticmethod
    def at(ended: float, seconds: float, decoding: int = 4, tokens: int = 4) -> StepTiming:
        return StepTiming(ended=ended, seconds=seconds, num_outputs=decoding, num_decoding=decoding, kv_blocks=8,
                          num_tokens=tokens)

    def test_one_stalled_step_does_not_set_it(self):
        meter = LoadMeter(block_size=16, window_s=10.0)
        for i, seconds in enumerate([0.1, 0.12, 10.0, 0.11, 0.1]):  # the third waited out a NATS outage
            meter.on_step(self.at(100.0 + i, seconds))
        window = meter.window(now=105.0)
        assert window is not None and window.steps == 5
        assert (window.batch, window.kv_tokens, window.seconds) == pytest.approx((4.0, 8 * 16, 0.11))

    def test_a_stalled_step_and_one_more_do_not_set_it(self):
        """As measured live: a decode instance stopped for 20 s woke with that step and one more in its window;
        their midpoint predicted 10 s between tokens."""
        meter = LoadMeter(block_size=16, window_s=10.0)
        meter.on_step(self.at(100.0, 20.0, decoding=1, tokens=1))
        meter.on_step(self.at(100.1, 0.007, decoding=1, tokens=1))
        window = meter.window(now=100.2)
        assert window is not None and window.seconds == pytest.approx(0.007)

    def test_steps_a_prompt_chunk_shared_add_their_excess_in_their_share(self):
        meter = LoadMeter(block_size=16, window_s=10.0)
        for i in range(9):
            meter.on_step(self.at(100.0 + i * 0.1, 0.15))
        meter.on_step(self.at(101.0, 6.0, tokens=2052))  # a 2,048-token chunk shared one step
        window = meter.window(now=101.0)
        assert window is not None and window.seconds == pytest.approx(0.15 + (6.0 - 0.15) / 10)
        assert window.prompt_s == pytest.approx((6.0 - 0.15) / 10)  # what the chunk added, apart

    def test_a_window_of_a_waves_prompts_alone_reaches_back_to_the_steps_before_them(self):
        """As measured live beside a busy loop: 8 streams' prompts took 10 s to compute, the window held only
        the steps they shared, and requests were turned away for a 3.3 s TBT while the streams decoded on at
        0.15 s a step."""
        meter = LoadMeter(block_size=16, window_s=10.0)
        decoding = [90.0 + i * 0.15 for i in range(64)]  # the last wave: 64 steps of 8 streams
        for ended in decoding:
            meter.on_step(self.at(ended, 0.15, decoding=8, tokens=8))
        for ended in (103.4, 106.7, 110.0):  # the next wave's prompts, 4 to a step, with 4 early streams
            meter.on_step(self.at(ended, 3.3, decoding=4, tokens=2048))
        window = meter.window(now=110.5)
        # just far enough back: 3 * 4 + 63 * 8 = 516 gaps, where 62 decoding steps would give 508
        assert 3 * 4 + 62 * 8 < PACE_GAPS <= 3 * 4 + 63 * 8
        assert window is not None and window.steps == 3 + 63
        gaps = 3 * 4 + 63 * 8
        assert window.prompt_s == pytest.approx(3 * 4 * (3.3 - 0.15) / gaps)
        assert window.seconds == pytest.approx(0.15 + window.prompt_s)
        # the history it reaches into is no longer than that: 60 s on, a window of prompt steps is theirs alone
        meter.on_step(self.at(171.0, 3.3, decoding=4, tokens=2048))
        assert meter.window(now=171.0) == StepPace(steps=1, batch=4.0, kv_tokens=8 * 16, seconds=3.3, prompt_s=0.0)

    def test_each_step_counts_once_per_sequence_it_advanced(self):
        """As measured live (8 streams of 512-token prompts): chunks came in as others finished, sharing steps
        with 2-4 decoders where 8 decoded otherwise; counted per step, the window said 150 ms between tokens
        where the streams saw 55-125."""
        meter = LoadMeter(block_size=16, window_s=10.0)
        for i in range(9):
            meter.on_step(self.at(100.0 + i * 0.1, 0.15, decoding=8, tokens=8))
        meter.on_step(self.at(101.0, 6.0, decoding=2, tokens=2050))
        window = meter.window(now=101.0)
        assert window is not None
        gaps = 9 * 8 + 2  # tokens the streams received in the window
        assert window.seconds == pytest.approx((9 * 8 * 0.15 + 2 * 6.0) / gaps)  # their mean gap
        assert window.batch == pytest.approx((9 * 8 * 8 + 2 * 2) / gaps)

    def test_it_reaches_back_to_a_decode_only_step_for_the_level(self):
        meter = LoadMeter(block_size=16, window_s=10.0)
        meter.on_step(self.at(100.0, 0.1, decoding=8, tokens=8))
        for i in range(9):  # prompt chunks with 64 decoding: more than enough gaps, and no level among them
            meter.on_step(self.at(101.0 + i, 1.0, decoding=64, tokens=2048))
        window = meter.window(now=109.5)
        assert window is not None and window.steps == 10
        assert window.prompt_s == pytest.approx(9 * 64 * (1.0 - 0.1) / (8 + 9 * 64))

    def test_it_does_not_reach_back_across_idleness(self):
        """A slow spell before a window's length of idleness does not come back with the first step after."""
        meter = LoadMeter(block_size=16, window_s=10.0)
        for i in range(10):
            meter.on_step(self.at(100.0 + i, 1.0, decoding=8, tokens=8))
        meter.on_step(self.at(140.05, 0.05, decoding=8, tokens=8))
        window = meter.window(now=140.1)
        assert window is not None and (window.steps, window.seconds) == (1, pytest.approx(0.05))

    def test_it_forgets(self):
        meter = LoadMeter(block_size=16, window_s=10.0)
        meter.on_step(self.at(100.0, 0.5))
        meter.on_step(self.at(100.0, 0.3, decoding=0, tokens=512))  # no decoding sequence: no gap anyone saw
        assert meter.window(now=105.0) is not None
        assert meter.window(now=111.0) is None
        load = meter.load(EngineStats(running=0, waiting=0, free_blocks=1, total_blocks=1), 0, 0, now=111.0)
        assert load.window_steps is None


class TestRecentLoad:
    """The TTFT and TBT a heartbeat reports are means over the last window, and forget."""

    STATS = EngineStats(running=0, waiting=0, free_blocks=10, total_blocks=10)

    def test_means_cover_the_window_only(self):
        meter = LoadMeter(block_size=16, window_s=10.0)
        meter.on_step(StepTiming(ended=100.0, seconds=0.9, num_outputs=1, num_decoding=1, kv_blocks=1, num_tokens=1))
        meter.on_step(StepTiming(ended=105.0, seconds=0.1, num_outputs=1, num_decoding=1, kv_blocks=1, num_tokens=1))
        meter.on_step(StepTiming(ended=106.0, seconds=0.3, num_outputs=0, num_decoding=0, kv_blocks=1, num_tokens=64))
        meter.on_first_token(2.0, now=104.0)
        load = meter.load(self.STATS, in_flight=0, accepted_total=3, now=108.0)
        assert load.tbt_ms == pytest.approx(500.0)  # the two steps that produced tokens; a bare prefill chunk is no TBT
        assert load.ttft_ms == pytest.approx(2000.0)
        load = meter.load(self.STATS, in_flight=0, accepted_total=3, now=112.0)
        assert load.tbt_ms == pytest.approx(100.0)  # the slow step fell out of the window

    def test_an_idle_instance_reports_no_latency(self):
        meter = LoadMeter(block_size=16, window_s=10.0)
        meter.on_step(StepTiming(ended=100.0, seconds=5.0, num_outputs=4, num_decoding=4, kv_blocks=9, num_tokens=4))
        meter.on_first_token(7.0, now=100.0)
        load = meter.load(self.STATS, in_flight=0, accepted_total=4, now=111.0)
        assert (load.tbt_ms, load.ttft_ms) == (None, None)
