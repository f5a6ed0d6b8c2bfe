"""A TBT target sizes each step's prompt chunks to what the step's decodes leave."""

from __future__ import annotations

from pathlib import Path

import pytest

from halfmoon.core.errors import InvalidRequestError
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.step_budget import StepBudget
from tests.engine.conftest import make_engine, random_prompts
from tests.engine.test_exactness import GREEDY, LENGTHS


def learned(target_s: float = 0.25, decode_s: float = 0.125, per_token_s: float = 2 ** -9) -> StepBudget:
    """A budget that measured decodes alone at ``decode_s`` and each prompt token at ``per_token_s``."""
    budget = StepBudget(target_s, max_tokens=512, min_prefill_tokens=16)
    budget.record(num_decoding=4, num_prompt_tokens=0, seconds=decode_s)
    budget.record(num_decoding=4, num_prompt_tokens=100, seconds=decode_s + 100 * per_token_s)
    return budget


class TestStepBudget:
    def test_prompt_tokens_fill_what_the_decodes_leave_of_the_target(self) -> None:
        assert learned().prefill_tokens(num_decoding=4) == 64  # (0.25 - 0.125) * 512

    def test_decodes_slower_than_the_target_still_leave_the_floor(self) -> None:
        assert learned(decode_s=0.3).prefill_tokens(num_decoding=4) == 16

    def test_never_more_than_the_step_holds(self) -> None:
        assert learned(target_s=10.0).prefill_tokens(num_decoding=12) == 500

    def test_without_decodes_or_target_a_step_takes_everything(self) -> None:
        assert learned().prefill_tokens(num_decoding=0) == 512
        off = StepBudget(0.0, max_tokens=512, min_prefill_tokens=16)
        off.record(4, 0, 0.1)
        off.record(4, 100, 5.0)
        assert off.prefill_tokens(4) == 508

    def test_decodes_alone_are_measured_first(self) -> None:
        budget = StepBudget(0.25, max_tokens=512, min_prefill_tokens=16)
        assert budget.prefill_tokens(4) == 0
        budget.record(4, 0, 0.1)
        assert budget.prefill_tokens(4) == 16  # the cost of a prompt token is not known yet: the floor

    def test_a_slower_prompt_step_shrinks_the_next(self) -> None:
        budget = learned()
        budget.record(4, 64, 0.125 + 64 * 3 * 2 ** -9)  # prompt tokens got 3x dearer (a longer context)
        assert budget.prefill_tokens(4) < 64

    def test_decodes_alone_are_measured_again_every_probe_interval(self) -> None:
        budget = StepBudget(0.25, max_tokens=512, min_prefill_tokens=16, probe_every=3)
        budget.record(4, 0, 0.1)
        for _ in range(3):
            assert budget.prefill_tokens(4) > 0
            budget.record(4, 50, 0.2)
        assert budget.prefill_tokens(4) == 0
        budget.record(8, 0, 0.2)
        assert budget.decode_s == pytest.approx(0.13)  # moving average, smoothing 0.3
        assert budget.prefill_tokens(8) > 0

    def test_a_prompt_s_own_target_takes_no_probe_and_the_floor_until_decodes_are_measured(self) -> None:
        off = StepBudget(0.0, max_tokens=512, min_prefill_tokens=16, probe_every=3)
        assert off.prefill_tokens(4, target_s=0.25) == 16  # nothing measured yet: the floor, not a probe
        off.record(4, 0, 0.125)
        off.record(4, 100, 0.125 + 100 * 2 ** -9)
        for _ in range(5):  # steps with prompt tokens go on past the probe interval
            assert off.prefill_tokens(4, target_s=0.25) == 64
            off.record(4, 64, 0.25)
        assert off.prefill_tokens(4) == 508  # the engine's own steps: no target, everything

    @pytest.mark.parametrize("bad", [dict(target_s=-1.0), dict(target_s=float("nan")),
                                     dict(min_prefill_tokens=0), dict(min_prefill_tokens=600)])
    def test_bad_settings_are_refused(self, bad: dict[str, float]) -> None:
        settings: dict[str, float] = dict(target_s=0.25, max_tokens=512, min_prefill_tokens=16) | bad
        with pytest.raises(ValueError):
            StepBudget(**settings)  # type: ignore[arg-type]

    def test_engine_config_refuses_a_negative_target(self) -> None:
        with pytest.raises(ValueError, match="step_time_target_s"):
            EngineConfig(model="x", step_time_target_s=-0.1)


def prefill_share(engine: LLMEngine, tokens_per_step: int) -> None:
    """Make ``engine``'s budget give ``tokens_per_step`` prompt tokens to every step that decodes."""
    budget = engine.scheduler.step_budget
    budget.decode_s, budget.per_prompt_token_s = 0.0, budget.target_s / tokens_per_step
    budget.record = lambda *_: None  # type: ignore[method-assign]  # hold the figures this test set


class TestSchedulerUnderBudget:
    def test_decodes_all_run_and_a_long_prompt_gets_the_rest(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama, step_time_target_s=0.5, max_num_batched_tokens=512,
                             prefill_chunk_size=64)
        prefill_share(engine, 20)
        *short, long = random_prompts(engine.vocab_size, [8, 8, 8, 300], seed=3)
        engine.add_request("long", long, GREEDY)
        engine.step()
        for i, prompt in enumerate(short):
            engine.add_request(f"s{i}", prompt, GREEDY)
        engine.step()  # nothing decodes yet: whole chunks for all four
        (seq,) = [seq for seq in engine.scheduler.running if seq.num_tokens == 300]
        assert seq.num_computed_tokens == 128
        for step in range(1, 4):  # the long prompt runs ahead of the three in the batch, but they decode
            produced = {out.request_id: len(out.new_token_ids) for out in engine.step()}
            assert produced == {"s0": 1, "s1": 1, "s2": 1}
            assert seq.num_computed_tokens == 128 + 20 * step
            assert engine.last_step_tokens == 3 + 20

    def test_outputs_equal_an_unbudgeted_engine_preemptions_included(self, tiny_llama: Path) -> None:
        free = make_engine(tiny_llama)
        budgeted = make_engine(tiny_llama, step_time_target_s=0.5, kv_cache_blocks=14)
        prefill_share(budgeted, 5)
        prompts = random_prompts(free.vocab_size, LENGTHS, seed=9)
        assert budgeted.generate(prompts, GREEDY) == free.generate(prompts, GREEDY)
        assert budgeted.scheduler.num_preemptions > 0
        assert budgeted.num_free_blocks == 14


DECODE_S, PER_TOKEN_S = 2 ** -4, 2 ** -8
TARGET_S = DECODE_S + 20 * PER_TOKEN_S  # leaves 20 prompt tokens a step


class TestPacedPrompt:
    """A prompt the conductor admitted paced keeps the steps it shares within its own target, whatever the
    engine's (here none); the others are computed as before."""

    def engine(self, tiny_llama: Path) -> LLMEngine:
        engine = make_engine(tiny_llama, max_num_batched_tokens=512, prefill_chunk_size=64)
        budget = engine.scheduler.step_budget
        budget.decode_s, budget.per_prompt_token_s = DECODE_S, PER_TOKEN_S
        budget.record = lambda *_: None  # type: ignore[method-assign]  # hold the figures this test set
        return engine

    def test_its_chunks_fill_what_the_decodes_leave_of_its_target(self, tiny_llama: Path) -> None:
        engine = self.engine(tiny_llama)
        *short, paced, free = random_prompts(engine.vocab_size, [8, 8, 8, 300, 300], seed=5)
        for i, prompt in enumerate(short):
            engine.add_request(f"s{i}", prompt, GREEDY)
        engine.step()  # the three prompts, whole
        engine.add_request("paced", paced, GREEDY, step_target_s=TARGET_S)
        engine.step()
        (seq,) = [s for s in engine.scheduler.running if s.request_id == "paced"]
        assert seq.num_computed_tokens == 20
        assert engine.last_step_tokens == 3 + 20
        engine.add_request("free", free, GREEDY)
        engine.step()  # the paced prompt first, then a whole chunk of the other, unpaced
        assert seq.num_computed_tokens == 40
        assert engine.last_step_tokens == 3 + 20 + 64

    def test_it_waits_its_turn_where_prompts_ahead_of_it_took_its_target(self, tiny_llama: Path) -> None:
        engine = self.engine(tiny_llama)
        *short, free, paced = random_prompts(engine.vocab_size, [8, 8, 8, 300, 300], seed=5)
        for i, prompt in enumerate(short):
            engine.add_request(f"s{i}", prompt, GREEDY)
        engine.step()
        engine.add_request("free", free, GREEDY)
        engine.add_request("paced", paced, GREEDY, step_target_s=TARGET_S)
        for _ in range(3):
            engine.step()
            assert engine.last_step_tokens == 3 + 64
            assert [seq.request_id for seq in engine.scheduler.waiting] == ["paced"]

    def test_with_nothing_decoding_it_takes_whole_chunks(self, tiny_llama: Path) -> None:
        engine = self.engine(tiny_llama)
        (prompt,) = random_prompts(engine.vocab_size, [300], seed=6)
        engine.add_request("alone", prompt, GREEDY, step_target_s=TARGET_S)
        engine.step()
        (seq,) = engine.scheduler.running
        assert seq.num_computed_tokens == 64

    def test_its_output_is_the_unpaced_one(self, tiny_llama: Path) -> None:
        engine = self.engine(tiny_llama)
        *short, long = random_prompts(engine.vocab_size, [8, 8, 8, 300], seed=7)
        outputs: dict[str, list[int]] = {"s0": [], "s1": [], "s2": [], "paced": []}
        for i, prompt in enumerate(short):
            engine.add_request(f"s{i}", prompt, GREEDY)
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        engine.add_request("paced", long, GREEDY, step_target_s=TARGET_S)
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id] += out.new_token_ids
        assert list(outputs.values()) == make_engine(tiny_llama).generate([*short, long], GREEDY)

    def test_a_bad_target_is_refused(self, tiny_llama: Path) -> None:
        engine = self.engine(tiny_llama)
        for bad in (-0.1, float("nan"), float("inf")):
            with pytest.raises(InvalidRequestError, match="step_target_s"):
                engine.add_request("bad", [1, 2, 3], GREEDY, step_target_s=bad)
