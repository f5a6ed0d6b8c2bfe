"""A pool prefix imported layer by layer: each layer copied in just before the step computes it, so
the next layer's transfer overlaps this layer's compute; a source that gives out costs only its
own sequence a recompute."""

from __future__ import annotations

from pathlib import Path

import torch

from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.hooks import LayerHook, LayerHooks
from halfmoon.engine.interface import LayerSource, LayerUnavailable, RequestKV
from halfmoon.engine.layer_import import ReadyKV
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine, random_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class Arriving(LayerSource):
    """Hands out the layers of known KV, recording when each is asked for; ``lost_at`` never arrives."""

    def __init__(self, kv: ReadyKV, events: list[str], lost_at: int | None = None) -> None:
        self.kv, self.events, self.lost_at = kv, events, lost_at
        self.closed = False

    @property
    def num_tokens(self) -> int:
        return self.kv.num_tokens

    def layer(self, layer: int) -> torch.Tensor:
        self.events.append(f"import {layer}")
        if layer == self.lost_at:
            raise LayerUnavailable(f"layer {layer} lost")
        return self.kv.layer(layer)

    def close(self) -> None:
        self.closed = True


class Computed(LayerHook):
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def after_layer(self, layer, chunks, cache) -> None:  # type: ignore[no-untyped-def]
        self.events.append(f"computed {layer}")


def pool_blocks(model: Path, prompt: list[int]) -> tuple[list[bytes], LLMEngine]:  # type: ignore[type-arg]
    """The prompt's first two blocks as another instance exported them, and that instance."""
    source = make_engine(model)
    source.add_request("p", prompt, GREEDY, prefill_only=True)
    while source.has_unfinished():
        source.step()
    return source.export_kv("p")[:2], source


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], dict]]) -> dict[str, tuple[list[int], int]]:  # type: ignore[type-arg]
    """Generate every request in one batch; each one's tokens and cached-token count."""
    for rid, (prompt, options) in requests.items():
        engine.add_request(rid, prompt, GREEDY, **options)
    out: dict[str, tuple[list[int], int]] = {rid: ([], 0) for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            tokens, cached = out[o.request_id]
            out[o.request_id] = (tokens + o.new_token_ids, max(cached, o.num_cached_tokens))
    return out


class TestLayerwiseImport:
    def test_each_layer_arrives_after_the_one_before_computed_and_the_output_is_unchanged(
            self, tiny_llama: Path) -> None:
        (prompt,) = random_prompts(1000, [40], seed=11)
        blocks, _ = pool_blocks(tiny_llama, prompt)
        engine, events = make_engine(tiny_llama), []
        engine.runner.layer_hook = LayerHooks(engine.layer_import, Computed(events), engine.layer_export)
        source = Arriving(ReadyKV(engine.layout, blocks), events)
        layered = run(engine, {"r": (prompt, {"kv": RequestKV(source=source)})})["r"]
        whole = run(make_engine(tiny_llama), {"r": (prompt, {"kv": RequestKV(source=blocks)})})["r"]
        cold = run(make_engine(tiny_llama), {"r": (prompt, {})})["r"]
        assert layered == whole and layered[0] == cold[0] and layered[1] == 32  # two blocks not recomputed
        layers = engine.layout.num_layers
        first_step = events[: 2 * layers]
        # layer l is needed only once layer l - 1 has computed: its transfer overlaps that compute
        assert first_step == [e for i in range(layers) for e in (f"import {i}", f"computed {i}")]
        assert source.closed and all(not e.startswith("import") for e in events[2 * layers:])

    def test_a_lost_layer_recomputes_only_its_request(self, tiny_llama: Path) -> None:
        a, b = random_prompts(1000, [40, 30], seed=12)
        blocks, _ = pool_blocks(tiny_llama, a)
        engine, events = make_engine(tiny_llama), []
        source = Arriving(ReadyKV(engine.layout, blocks), events, lost_at=1)
        out = run(engine, {"lost": (a, {"kv": RequestKV(source=source)}), "other": (b, {})})
        expected = run(make_engine(tiny_llama), {"lost": (a, {}), "other": (b, {})})
        assert out["lost"][0] == expected["lost"][0] and out["other"] == expected["other"]
        assert out["lost"][1] == 0  # recomputed from the start: nothing counted as cached
        assert events == ["import 0", "import 1"] and source.closed  # asked no further, then let go
        assert engine.num_free_blocks == engine.blocks.pool.num_blocks - len(engine.blocks.pool.cached)

    def test_a_source_the_local_cache_made_unneeded_is_closed_unread(self, tiny_llama: Path) -> None:
        (prompt,) = random_prompts(1000, [40], seed=13)
        blocks, source_engine = pool_blocks(tiny_llama, prompt)
        keys = source_engine.kv_spec.hasher(None).keys(prompt)[:2]
        engine, events = make_engine(tiny_llama), []
        run(engine, {"warm": (prompt, {"block_keys": keys})})  # the local cache now holds both blocks
        source = Arriving(ReadyKV(engine.layout, blocks), events)
        run(engine, {"r": (prompt, {"kv": RequestKV(source=source), "block_keys": keys})})
        assert events == [] and source.closed
