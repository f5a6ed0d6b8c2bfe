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


def _native_choice():
    from halfmoon.engine import native
    from halfmoon.engine.sampler import NativeChoice

    library = native.library("sampling")
    if library is None:
        pytest.skip(f"no sampling kernel here ({native.loaded('sampling').reason}): the PyTorch form is tested")
    return NativeChoice(library)


@pytest.fixture(params=["pytorch", "kernel"])
def choice(request):
    """Each form of the token choice: PyTorch's, and the C kernel's."""
    from halfmoon.engine.sampler import choose

    return choose if request.param == "pytorch" else _native_choice()


class TestTokenChoice:
    """The contract of ``sampler.choose``, held by the PyTorch form and the kernel alike."""

    PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4])

    def test_a_uniform_takes_the_token_its_share_of_the_mass_falls_in(self, choice) -> None:
        # cumulative 0.1, 0.3, 0.6, 1.0: each uniform lies inside one token's interval
        uniform = torch.tensor([0.05, 0.2, 0.31, 0.59, 0.61, 0.999], dtype=torch.float64)
        logits = (self.PROBS.log() + 3.0)[None].expand(len(uniform), -1).contiguous()
        tokens, logprobs = choice(logits, None, torch.ones(len(uniform), dtype=torch.float64), uniform)
        assert tokens.tolist() == [0, 1, 2, 2, 3, 3]
        torch.testing.assert_close(logprobs, self.PROBS.log()[tokens], atol=1e-5, rtol=0)

    def test_the_temperature_reshapes_the_mass(self, choice) -> None:
        # at temperature 0.5 the weights are the squares: 0.01, 0.04, 0.09, 0.16 of 0.30
        logits = self.PROBS.log()[None].expand(2, -1).contiguous()
        uniform = torch.tensor([0.16, 0.17], dtype=torch.float64)  # 0.0498 and 0.051 of 0.30; the first ends 0.05
        tokens, _ = choice(logits, None, torch.full((2,), 0.5, dtype=torch.float64), uniform)
        assert tokens.tolist() == [1, 2]

    def test_temperature_zero_takes_the_first_largest_logit(self, choice) -> None:
        logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
        tokens, logprobs = choice(logits, None, torch.zeros(2, dtype=torch.float64),
                                  torch.full((2,), 0.7, dtype=torch.float64))
        assert tokens.tolist() == [1, 0]
        torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])

    def test_masked_entries_are_never_drawn_and_logprobs_stay_unfiltered(self, choice) -> None:
        logits = self.PROBS.log()[None].expand(3, -1).contiguous()
        masked = logits.clone()
        masked[:, 1] = masked[:, 3] = float("-inf")  # the filter kept tokens 0 and 2, a quarter and three quarters
        uniform = torch.tensor([0.0, 0.26, 1.0 - 2 ** -53], dtype=torch.float64)
        tokens, logprobs = choice(logits, masked, torch.ones(3, dtype=torch.float64), uniform)
        assert tokens.tolist() == [0, 2, 2]
        torch.testing.assert_close(logprobs, self.PROBS.log()[tokens], atol=1e-5, rtol=0)

    def test_a_token_of_weight_zero_is_never_drawn_at_the_ends(self, choice) -> None:
        logits = torch.tensor([[-200.0, 0.0, -300.0, 0.0, -200.0]]).expand(2, -1).contiguous()
        uniform = torch.tensor([0.0, 1.0 - 2 ** -53], dtype=torch.float64)
        tokens, _ = choice(logits, None, torch.ones(2, dtype=torch.float64), uniform)
        assert tokens.tolist() == [1, 3]

    @pytest.mark.parametrize("temperature", [1e-30, 1e-45, 5e-324])
    def test_a_temperature_under_floats_range_is_greedy(self, choice, temperature: float) -> None:
        logits = torch.tensor([[0.5, 2.0, 1.9999, -1.0]]).expand(3, -1).contiguous()
        tokens, _ = choice(logits, None, torch.full((3,), temperature, dtype=torch.float64),
                           torch.tensor([0.0, 0.5, 0.999], dtype=torch.float64))
        assert tokens.tolist() == [1, 1, 1]

    def test_the_kernel_and_pytorch_agree_over_a_vocabulary(self) -> None:
        from halfmoon.engine.sampler import choose

        kernel = _native_choice()
        gen = torch.Generator().manual_seed(3)
        logits = torch.randn(64, 49152, generator=gen) * 4
        temperature = torch.rand(64, generator=gen, dtype=torch.float64) * 1.5
        temperature[::8] = 0.0
        uniform = torch.rand(64, generator=gen, dtype=torch.float64)
        tokens, logprobs = kernel(logits, None, temperature, uniform)
        expected_tokens, expected_logprobs = choose(logits, None, temperature, uniform)
        # the two sum exp in different orders: a draw within a rounding of a boundary may fall either side
        x = (logits - logits.max(-1, keepdim=True).values) / temperature.clamp(min=1e-30).float()[:, None]
        cdf = x.exp().double().cumsum(-1)
        target = uniform * cdf[:, -1]
        near = (cdf - target[:, None]).abs().min(-1).values < 1e-9 * cdf[:, -1]
        assert not near.all()
        assert torch.equal(tokens[~near], expected_tokens[~near])
        torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=1e-5)
