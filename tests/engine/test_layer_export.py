"""A prefill-only request's KV leaves the engine layer by layer, while later layers still compute."""

from __future__ import annotations

from pathlib import Path

import pytest

from halfmoon.core.block_format import read_header
from halfmoon.core.errors import InvalidRequestError
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.hooks import LayerHook
from halfmoon.engine.interface import RequestKV
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine, random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


class _Sink:
    def __init__(self) -> None:
        self.layers: list[int] = []
        self.snapshots: dict[int, list[bytes]] = {}
        self.payloads: list[bytearray] = []

    def __call__(self, layer: int, payloads: list[bytearray]) -> None:
        self.layers.append(layer)
        self.snapshots[layer] = [bytes(p) for p in payloads]
        self.payloads = payloads


def run_prefill(engine: LLMEngine, prompt: list[int], sink: _Sink, first_block: int = 0) -> None:
    engine.add_request("p", prompt, GREEDY, prefill_only=True, kv=RequestKV(sink=sink, sink_from_block=first_block))
    while engine.has_unfinished():
        engine.step()


class TestStreamedPayloads:
    @pytest.mark.parametrize(("length", "first_block"), [(5, 0), (16, 0), (45, 0), (45, 1), (45, 2)])
    def test_last_layer_leaves_the_exported_blocks(self, tiny_llama: Path, length: int, first_block: int) -> None:
        engine = make_engine(tiny_llama)  # 32-token chunks: 45 tokens take two steps
        (prompt,) = random_prompts(engine.vocab_size, [length], seed=length)
        sink = _Sink()
        run_prefill(engine, prompt, sink, first_block)
        assert sink.layers == list(range(engine.layout.num_layers))
        assert [bytes(p) for p in sink.payloads] == [bytes(b) for b in engine.export_kv("p")[first_block:]]

    def test_each_layer_is_final_when_announced(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama)
        (prompt,) = random_prompts(engine.vocab_size, [40], seed=7)
        sink = _Sink()
        run_prefill(engine, prompt, sink)
        final = engine.export_kv("p")
        layout = engine.layout
        for layer, snapshot in sink.snapshots.items():
            for block, payload in zip(snapshot, final):
                size = layout.layer_nbytes(read_header(payload).num_tokens)
                done = layout.header_nbytes + (layer + 1) * size
                assert block[:done] == bytes(payload[:done])
                assert block[done:] == bytes(len(block) - done)  # later layers not written yet


class _Order(LayerHook):
    """Wraps the engine's hook and records when each layer starts computing."""

    def __init__(self, inner: LayerHook, events: list[tuple[str, int]]) -> None:
        self.inner, self.events = inner, events

    def before_layer(self, layer, chunks, cache) -> None:
        self.events.append(("compute", layer))
        self.inner.before_layer(layer, chunks, cache)

    def after_layer(self, layer, chunks, cache) -> None:
        self.inner.after_layer(layer, chunks, cache)


class TestOverlap:
    def test_layer_zero_is_out_before_the_last_layer_computes(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama, max_num_batched_tokens=64, prefill_chunk_size=64)
        events: list[tuple[str, int]] = []
        engine.runner.layer_hook = _Order(engine.layer_export, events)
        (prompt,) = random_prompts(engine.vocab_size, [24], seed=4)
        run_prefill(engine, prompt, lambda layer, _p: events.append(("sent", layer)))  # type: ignore[arg-type]
        last = engine.layout.num_layers - 1
        assert events.index(("sent", 0)) < events.index(("compute", last))
        assert [e for e in events if e[0] == "sent"] == [("sent", i) for i in range(last + 1)]

    def test_released_and_plain_requests_are_not_streamed(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama)
        (prompt,) = random_prompts(engine.vocab_size, [20], seed=5)
        with pytest.raises(InvalidRequestError, match="prefill-only"):
            engine.add_request("x", prompt, GREEDY, kv=RequestKV(sink=_Sink()))
        sink = _Sink()
        run_prefill(engine, prompt, sink)
        engine.release("p")
        assert not engine.layer_export._streams
