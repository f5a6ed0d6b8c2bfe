"""Greedy output of the paged engine equals transformers generate, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine, random_prompts

LENGTHS = [1, 3, 15, 16, 17, 40, 75, 130]
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    outs = []
    for prompt in prompts:
        # An explicit mask: generate would otherwise treat prompt tokens equal to pad as padding.
        tokens = torch.tensor([prompt])
        ids = hf.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=MAX_TOKENS,
                          min_new_tokens=MAX_TOKENS, do_sample=False)
        outs.append(ids[0, len(prompt):].tolist())
    return outs


def run_staggered(engine, prompts: list[list[int]]) -> list[list[int]]:
    """Half the requests start at once; the rest join one by one while the batch runs."""
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    for index, prompt in pending[: len(prompts) // 2]:
        engine.add_request(f"r{index}", prompt, GREEDY)
        outputs[f"r{index}"] = []
    joined_mid_flight = 0
    late = pending[len(prompts) // 2:]
    while engine.has_unfinished() or late:
        if late:
            index, prompt = late.pop(0)
            engine.add_request(f"r{index}", prompt, GREEDY)
            outputs[f"r{index}"] = []
            joined_mid_flight += engine.has_unfinished()
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    assert joined_mid_flight == len(prompts) - len(prompts) // 2
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
class TestGreedyMatchesTransformers:
    def test_continuous_batch_with_late_joiners(self, tiny_models: dict[str, Path], arch: str) -> None:
        engine = make_engine(tiny_models[arch])
        prompts = random_prompts(engine.vocab_size, LENGTHS, seed=7)
        assert run_staggered(engine, prompts) == reference(tiny_models[arch], prompts)

    def test_one_big_prefill_chunk(self, tiny_models: dict[str, Path], arch: str) -> None:
        engine = make_engine(tiny_models[arch], max_num_batched_tokens=512, prefill_chunk_size=512)
        prompts = random_prompts(engine.vocab_size, LENGTHS, seed=8)
        assert engine.generate(prompts, GREEDY) == reference(tiny_models[arch], prompts)


class TestPreemption:
    def test_small_block_budget_gives_same_outputs(self, tiny_llama: Path) -> None:
        roomy = make_engine(tiny_llama)
        tight = make_engine(tiny_llama, kv_cache_blocks=14)
        prompts = random_prompts(roomy.vocab_size, LENGTHS, seed=9)
        expected = roomy.generate(prompts, GREEDY)
        assert tight.generate(prompts, GREEDY) == expected
        assert tight.scheduler.num_preemptions > 0
        assert tight.num_free_blocks == 14
