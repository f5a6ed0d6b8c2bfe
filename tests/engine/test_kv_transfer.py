"""KV leaves one engine as pool-format blocks and continues decoding in another."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from halfmoon.core.block_format import decode_block, decode_layer, read_header, seal_block, verify_block, verify_layer
from halfmoon.core.errors import KVFormatError
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.hooks import LayerHook
from halfmoon.engine.interface import PREFILL_DONE, RequestKV
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine, random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def prefill(engine: LLMEngine, request_id: str, prompt: list[int]) -> int:
    engine.add_request(request_id, prompt, GREEDY, prefill_only=True)
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    (out,) = outputs
    assert out.finish_reason == PREFILL_DONE
    return out.new_token_ids[0]


def decode(engine: LLMEngine, prompt: list[int], first: int, blocks: list[bytes]) -> list[int]:
    engine.add_request("d", prompt, GREEDY, output_token_ids=[first], kv=RequestKV(source=blocks))
    tokens = [first]
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


class TestExportImport:
    @pytest.mark.parametrize("length", [5, 16, 45])
    def test_round_trip_decodes_the_same_tokens(self, tiny_llama: Path, length: int) -> None:
        source, target = make_engine(tiny_llama), make_engine(tiny_llama)
        (prompt,) = random_prompts(source.vocab_size, [length], seed=length)
        expected = make_engine(tiny_llama).generate([prompt], GREEDY)[0]
        first = prefill(source, "p", prompt)
        blocks = source.export_kv("p")
        assert len(blocks) == -(-length // 16)
        assert [read_header(b).num_tokens for b in blocks][-1] == length - 16 * (len(blocks) - 1)
        source.release("p")
        assert source.num_free_blocks == source.blocks.pool.num_blocks
        computed_before = target.blocks.pool.num_free
        assert decode(target, prompt, first, blocks) == expected
        assert target.num_free_blocks == computed_before

    def test_imported_prefix_is_not_recomputed(self, tiny_llama: Path) -> None:
        source, target = make_engine(tiny_llama), make_engine(tiny_llama)
        (prompt,) = random_prompts(source.vocab_size, [48], seed=3)
        first = prefill(source, "p", prompt)
        blocks = source.export_kv("p")
        target.add_request("d", prompt, GREEDY, output_token_ids=[first], kv=RequestKV(source=blocks))
        (chunk,) = target.scheduler.schedule()
        assert (chunk.start, chunk.num_tokens) == (48, 1)


class TestPromptExportWithTheFirstToken:
    """An aggregated request keeps generating after its prompt: the first output carries the prompt's full
    blocks, taken before a short answer can end and free them."""

    @pytest.mark.parametrize(("length", "start"), [(45, 0), (45, 1), (48, 2), (15, 0)])
    def test_the_first_output_holds_the_prompt_blocks_from_start(self, tiny_llama: Path, length: int,
                                                                 start: int) -> None:
        engine, exporter = make_engine(tiny_llama), make_engine(tiny_llama)
        (prompt,) = random_prompts(engine.vocab_size, [length], seed=length)
        prefill(exporter, "p", prompt)
        expected = [bytes(b) for b in exporter.export_kv("p")[start:length // 16]]
        one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        engine.add_request("a", prompt, one_token, kv=RequestKV(export_prompt_from=start))
        outputs = []
        while engine.has_unfinished():  # 32-token chunks: 45 tokens take two steps
            outputs.extend(engine.step())
        (out,) = outputs
        assert out.finished  # its KV is freed now: only the output still has it
        assert [bytes(p) for p in out.prompt_kv] == expected

    def test_later_outputs_carry_none(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama)
        (prompt,) = random_prompts(engine.vocab_size, [40], seed=2)
        engine.add_request("a", prompt, GREEDY, kv=RequestKV(export_prompt_from=0))
        outputs = []
        while engine.has_unfinished():
            outputs.extend(engine.step())
        assert [len(o.prompt_kv) for o in outputs] == [2] + [0] * (len(outputs) - 1)


class TestBlockPayload:
    def test_each_layer_is_readable_alone(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama)
        (prompt,) = random_prompts(engine.vocab_size, [16], seed=1)
        prefill(engine, "p", prompt)
        (payload,) = engine.export_kv("p")
        key = bytes(range(32))
        seal_block(engine.layout, payload, key)
        kv = decode_block(engine.layout, payload, key)
        per_layer, start = engine.layout.layer_nbytes(16), engine.layout.header_nbytes
        layer2 = payload[start + 2 * per_layer: start + 3 * per_layer]
        as_tensor = torch.frombuffer(bytearray(layer2), dtype=engine.layout.dtype).view(kv[2].shape)
        assert torch.equal(as_tensor, kv[2])
        streamed = memoryview(payload)[: start + 3 * per_layer]  # received up to layer 2 so far
        assert torch.equal(decode_layer(engine.layout, streamed, 2, key), kv[2])
        assert not verify_layer(engine.layout, streamed, 2, bytes(32))  # sealed under another key

    def test_corruption_and_foreign_models_are_rejected(self, tiny_models: dict[str, Path]) -> None:
        engine = make_engine(tiny_models["llama"])
        (prompt,) = random_prompts(engine.vocab_size, [20], seed=2)
        first = prefill(engine, "p", prompt)
        blocks = engine.export_kv("p")
        keys = [bytes([i]) * 32 for i in range(len(blocks))]
        for block, key in zip(blocks, keys):
            seal_block(engine.layout, block, key)
        flipped = bytearray(blocks[0])
        flipped[-5] ^= 0xFF
        assert verify_block(engine.layout, blocks[0], keys[0]) and not verify_block(engine.layout, flipped, keys[0])
        assert not verify_block(engine.layout, blocks[0], keys[1])  # a valid block replayed under another key
        with pytest.raises(KVFormatError, match="MAC"):
            decode_block(engine.layout, flipped, keys[0])
        other = make_engine(tiny_models["qwen2"])
        with pytest.raises(KVFormatError):
            other.add_request("foreign", prompt, GREEDY, output_token_ids=[first],
                              kv=RequestKV(source=blocks))
        assert decode(engine, prompt, first, blocks)[:1] == [first]


class _Recorder(LayerHook):
    def __init__(self) -> None:
        self.after: dict[int, torch.Tensor] = {}
        self.order: list[tuple[str, int]] = []

    def before_layer(self, layer, chunks, cache) -> None:
        self.order.append(("before", layer))

    def after_layer(self, layer, chunks, cache) -> None:
        self.order.append(("after", layer))
        seq = chunks[0].seq
        self.after[layer] = cache.blocks(seq.block_table, chunks[0].start + chunks[0].num_tokens)[layer].clone()


class TestLayerHook:
    def test_hook_sees_each_layer_kv_as_it_is_written(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama, max_num_batched_tokens=64, prefill_chunk_size=64)
        hook = _Recorder()
        engine.runner.layer_hook = hook
        (prompt,) = random_prompts(engine.vocab_size, [24], seed=4)
        prefill(engine, "p", prompt)
        layers = engine.layout.num_layers
        assert hook.order == [(kind, i) for i in range(layers) for kind in ("before", "after")]
        exported = torch.cat([decode_block(engine.layout, b) for b in engine.export_kv("p")], dim=2)
        for layer in range(layers):
            assert torch.equal(hook.after[layer], exported[layer])
