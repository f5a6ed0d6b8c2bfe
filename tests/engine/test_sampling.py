"""Per-request sampling: seeds, filters, stop conditions, logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from halfmoon.engine.engine import LLMEngine
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine, random_prompts


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams, request_id: str = "r"):
    engine.add_request(request_id, prompt, params)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama)


class TestSeeds:
    def test_same_seed_same_tokens_different_seed_differs(self, engine: LLMEngine) -> None:
        (prompt,) = random_prompts(engine.vocab_size, [12], seed=1)
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
        first = tokens(run(engine, prompt, params))
        again = tokens(run(engine, prompt, params))
        other = tokens(run(engine, prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True)))
        assert first == again
        assert first != other

    def test_seeded_request_is_independent_of_its_batch(self, engine: LLMEngine) -> None:
        prompts = random_prompts(engine.vocab_size, [12, 30, 7], seed=2)
        params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
        alone = tokens(run(engine, prompts[0], params))
        batch = engine.generate(prompts, params)
        assert batch[0] == alone

    def test_top_k_one_is_greedy(self, engine: LLMEngine) -> None:
        (prompt,) = random_prompts(engine.vocab_size, [9], seed=3)
        greedy = tokens(run(engine, prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)))
        top1 = tokens(run(engine, prompt, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=5,
                                                         ignore_eos=True)))
        assert top1 == greedy


class TestResume:
    def test_resumed_at_position_p_samples_the_same_continuation(self, engine: LLMEngine) -> None:
        (prompt,) = random_prompts(engine.vocab_size, [11], seed=12)
        params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=321, ignore_eos=True)
        whole = tokens(run(engine, prompt, params))
        for p in (1, 7, 13):
            engine.add_request(f"resumed-{p}", prompt, params, output_token_ids=whole[:p])
            rest = []
            while engine.has_unfinished():
                rest += tokens(engine.step())
            assert whole[:p] + rest == whole

    def test_unseeded_requests_differ_from_each_other(self, engine: LLMEngine) -> None:
        (prompt,) = random_prompts(engine.vocab_size, [11], seed=13)
        params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
        assert tokens(run(engine, prompt, params)) != tokens(run(engine, prompt, params))


class TestStopConditions:
    def test_max_tokens_gives_length(self, engine: LLMEngine) -> None:
        (prompt,) = random_prompts(engine.vocab_size, [5], seed=4)
        outs = run(engine, prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert len(tokens(outs)) == 3 and outs[-1].finish_reason == "length" and outs[-1].finished

    def test_stop_token_ends_without_its_text(self, engine: LLMEngine) -> None:
        (prompt,) = random_prompts(engine.vocab_size, [5], seed=4)
        free = tokens(run(engine, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
        outs = run(engine, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                  stop_token_ids=(free[3],)))
        assert tokens(outs) == free[: free.index(free[3]) + 1]
        assert outs[-1].finish_reason == "stop"

    def test_stop_string_truncates_text(self, engine: LLMEngine) -> None:
        (prompt,) = random_prompts(engine.vocab_size, [6], seed=5)
        outs = run(engine, prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        full = "".join(o.text_delta for o in outs)
        assert full == engine.tokenizer.decode(tokens(outs), skip_special_tokens=True)
        stop = full[len(full) // 2: len(full) // 2 + 3]
        assert len(stop) == 3
        stopped = run(engine, prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=(stop,)))
        assert "".join(o.text_delta for o in stopped) == full[: full.index(stop)]
        assert stopped[-1].finish_reason == "stop"


class TestLogprobs:
    def test_chosen_token_logprobs_match_the_model(self, engine: LLMEngine, tiny_llama: Path) -> None:
        (prompt,) = random_prompts(engine.vocab_size, [10], seed=6)
        outs = run(engine, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True))
        hf = AutoModelForCausalLM.from_pretrained(tiny_llama)
        sequence = prompt + tokens(outs)
        with torch.no_grad():
            logits = hf(torch.tensor([sequence])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(tokens(outs))[:, None])
        got = torch.tensor([lp for o in outs for lp in o.new_logprobs])
        assert torch.allclose(got, expected.squeeze(1), atol=1e-4)


class TestTinyTemperature:
    @pytest.mark.parametrize("temperature", [5e-324, 1e-45, 1e-38])
    def test_a_temperature_that_overflows_the_logits_samples_greedily(self, engine: LLMEngine,
                                                                       temperature: float) -> None:
        prompt = [5, 9, 11, 42]
        greedy = tokens(run(engine, prompt, SamplingParams(max_tokens=4, temperature=0.0), "g"))
        tiny = tokens(run(engine, prompt, SamplingParams(max_tokens=4, temperature=temperature, top_p=5e-324), "t"))
        assert tiny == greedy


class TestDistribution:
    """Seeded draws follow the softmax of the logits, and a token of probability 0 is never drawn."""

    def test_frequencies_follow_the_probabilities(self) -> None:
        from halfmoon.engine.sampler import Sampler
        from halfmoon.engine.sequence import Sequence

        probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
        logits = probs.log()[None].expand(4000, -1).contiguous()
        params = SamplingParams(max_tokens=1, temperature=1.0)
        seqs = [Sequence(f"r{i}", [1, 2, 3], params, arrival=i, seed=i) for i in range(4000)]
        drawn = torch.tensor(Sampler()(logits, seqs).token_ids)
        counts = torch.bincount(drawn, minlength=4).double() / 4000
        assert counts[3] == 0
        # 4,000 draws: a share's standard error is at most 0.008; 4 of them is far outside chance
        assert torch.allclose(counts[:3], probs[:3].double(), atol=0.032)
