"""What an engine instance's heartbeat says about its steps: the decode cost model's samples."""

from __future__ import annotations

import pytest
from halfmoon.engine.async_engine import StepTiming
from halfmoon.service.worker import LoadMeter


class TestStepSamples:
    def test_decoding_steps_since_the_last_heartbeat_are_averaged_once(self):
        meter = LoadMeter(block_size=16)
        assert meter.take_steps() is None  # nothing ran yet
        meter.on_step(StepTiming(ended=1.0, seconds=0.10, num_outputs=2, num_decoding=2, kv_blocks=10))
        meter.on_step(StepTiming(ended=1.1, seconds=0.50, num_outputs=0, kv_blocks=40))  # a prefill chunk alone
        meter.on_step(StepTiming(ended=1.2, seconds=0.40, num_outputs=1, kv_blocks=41))  # a first token alone
        # four decoding and one first token: the decoding four waited for that prompt's last chunk
        meter.on_step(StepTiming(ended=1.3, seconds=0.30, num_outputs=5, num_decoding=4, kv_blocks=30))
        sample = meter.take_steps()
        assert sample is not None and sample.steps == 2
        assert (sample.batch, sample.kv_tokens, sample.seconds) == pytest.approx((3.0, 20 * 16, 0.2))
        assert meter.take_steps() is None  # each step is reported in one heartbeat only
        meter.on_step(StepTiming(ended=2.0, seconds=0.05, num_outputs=1, num_decoding=1, kv_blocks=2))
        assert meter.take_steps().batch == 1.0
