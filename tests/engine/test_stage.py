"""Pipeline stages (CPP): a prompt run chunk by chunk through two engines, each holding half of the layers,
gives the same first token and the same KV as one engine prefilling it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from halfmoon.core.errors import InvalidRequestError, OutOfKVBlocksError, UnknownRequestError
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.interface import StageChunk, StageResult, hidden_bytes, hidden_tensor, split_layers
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine, random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
CHUNK = 32  # the engines' prefill_chunk_size in make_engine: the same chunks as the pipeline


def run_pipeline(stages: list[LLMEngine], prompt: list[int], rid: str = "p", chunk: int = CHUNK,
                 prefix: list[bytes] = ()) -> StageResult:  # type: ignore[assignment]
    bounds = split_layers(stages[0].kv_spec.num_layers, len(stages))
    result = StageResult(None)
    cached = len(prefix) * stages[0].config.block_size
    for start in range(cached, len(prompt), chunk):
        part = tuple(prompt[start:start + chunk])
        first = dict(prefix_token_ids=tuple(prompt[:cached]), prefix_blocks=prefix) if start == cached else {}
        hidden = None
        for s, engine in enumerate(stages):
            if hidden is not None:  # the trip between processes: bytes in the model's dtype
                hidden = hidden_tensor(hidden_bytes(hidden), len(part), engine.config.torch_dtype)
            result = engine.stages.run(StageChunk(rid, part, start, range(bounds[s], bounds[s + 1]), hidden,
                                                  len(prompt), GREEDY, **first))  # type: ignore[arg-type]
            hidden = result.hidden
    return result


def reference(engine: LLMEngine, prompt: list[int]) -> tuple[int, float, list[bytes]]:
    engine.add_request("ref", prompt, GREEDY, prefill_only=True)
    out = []
    while engine.has_unfinished():
        out.extend(engine.step())
    return out[-1].new_token_ids[0], out[-1].new_logprobs[0], [bytes(b) for b in engine.export_kv("ref")]


def joined(stages: list[LLMEngine], length: int) -> list[bytes]:
    """Each block with the head's layers from the head and the tail's from the tail."""
    num_layers = stages[0].kv_spec.num_layers
    k = split_layers(num_layers, 2)[1]
    head, tail = stages[0].stages.payloads("p", range(k)), stages[1].stages.payloads("p", range(k, num_layers))
    layout, size = stages[0].layout, stages[0].config.block_size
    out = []
    for index, (a, b) in enumerate(zip(head, tail)):
        cut = layout.header_nbytes + k * layout.layer_nbytes(min(size, length - index * size))
        out.append(bytes(a[:cut]) + bytes(b[cut:]))
    return out


class TestTwoStagesEqualOne:
    @pytest.mark.parametrize("length", [5, 32, 77, 130])
    def test_first_token_and_kv(self, tiny_llama: Path, length: int) -> None:
        stages = [make_engine(tiny_llama), make_engine(tiny_llama)]
        (prompt,) = random_prompts(stages[0].vocab_size, [length], seed=length)
        result = run_pipeline(stages, prompt)
        token, logprob, blocks = reference(make_engine(tiny_llama), prompt)
        assert (result.token_id, result.logprob, result.finish_reason) == (token, logprob, "prefill_done")
        assert joined(stages, length) == blocks

    def test_after_a_reused_prefix(self, tiny_llama: Path) -> None:
        stages = [make_engine(tiny_llama), make_engine(tiny_llama)]
        (prompt,) = random_prompts(stages[0].vocab_size, [77], seed=3)
        token, logprob, blocks = reference(make_engine(tiny_llama), prompt)
        result = run_pipeline(stages, prompt, prefix=blocks[:2])  # chunks [32, 64) and [64, 77), as the reference
        assert (result.token_id, result.logprob) == (token, logprob)
        assert joined(stages, 77) == blocks  # the prefix's layers were loaded, each stage its own

    def test_first_stage_hands_on_hidden_states(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama)
        out = engine.stages.run(StageChunk("p", (1, 2, 3), 0, range(2), None, 10, GREEDY))
        assert out.token_id is None and out.hidden is not None and out.hidden.shape == (3, engine.hidden_size)


class TestStageRefusals:
    def test_chunks_out_of_order(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama)
        with pytest.raises(UnknownRequestError):
            engine.stages.run(StageChunk("p", (1, 2), 4, range(2), None, 10, GREEDY))
        engine.stages.run(StageChunk("p", (1, 2), 0, range(2), None, 10, GREEDY))
        with pytest.raises(InvalidRequestError):
            engine.stages.run(StageChunk("p", (1, 2), 5, range(2), None, 10, GREEDY))

    def test_hidden_states_of_the_wrong_shape(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama)
        with pytest.raises(InvalidRequestError):
            engine.stages.run(StageChunk("p", (1, 2), 0, range(2, 4), torch.zeros(3, engine.hidden_size), 10, GREEDY))
        with pytest.raises(InvalidRequestError):
            engine.stages.run(StageChunk("q", (1, 2), 0, range(2), torch.zeros(2, engine.hidden_size), 10, GREEDY))

    def test_out_of_blocks_and_release(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama, kv_cache_blocks=2)
        engine.stages.run(StageChunk("p", tuple(range(1, 33)), 0, range(2), None, 64, GREEDY))
        assert engine.num_free_blocks == 0
        with pytest.raises(OutOfKVBlocksError):
            engine.stages.run(StageChunk("p", (1,), 32, range(2), None, 64, GREEDY))
        assert engine.stages.release("p") and engine.num_free_blocks == 2
        assert not engine.stages.release("p")
