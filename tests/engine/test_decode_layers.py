"""kernels/decode_layers.c: a step of decodes through every layer in one call, bit for bit the layers one by one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from halfmoon.engine import native, weights
from halfmoon.engine.decode_layers import DecodeLayers
from halfmoon.engine.layer_import import LayerImport
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine, random_prompts, tokens_and_logprobs


@pytest.fixture
def linear_kernel_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 projections on kernels/linear.c whatever the CPU (its portable path where there is no
    AVX512-BF16), so that the layers kernel is taken here too."""
    if native.library("linear") is None or native.library("decode_layers") is None:
        pytest.skip(f"no C kernels here: {native.loaded('decode_layers').reason or native.loaded('linear').reason}")
    monkeypatch.setattr(weights, "_kernel_for", weights.linear_kernel)


class CountingLayers:
    """The engine's DecodeLayers, counting the steps it computed."""

    def __init__(self, inner: DecodeLayers) -> None:
        self.inner, self.steps = inner, 0

    def __call__(self, *args: object) -> torch.Tensor | None:
        out = self.inner(*args)  # type: ignore[arg-type]
        self.steps += out is not None
        return out


@pytest.mark.usefixtures("linear_kernel_everywhere")
class TestAgainstTheLayersOneByOne:
    @pytest.mark.parametrize(("temperature", "lengths"), [
        (0.0, [5, 40, 77, 16, 33]),
        (1.0, [5, 40, 77, 16, 33]),
        (1.0, [3 + 11 * i for i in range(19)]),  # rows in three tiles of the projections
    ])
    def test_tokens_and_logprobs_are_bit_for_bit_the_same(self, tiny_llama: Path, temperature: float,
                                                          lengths: list[int]) -> None:
        prompts = random_prompts(1000, lengths, seed=7)
        params = SamplingParams(max_tokens=24, temperature=temperature, seed=3, ignore_eos=True, logprobs=True)
        fused = make_engine(tiny_llama, dtype="bfloat16")
        assert fused.runner.decode_layers is not None
        counting = CountingLayers(fused.runner.decode_layers)
        fused.runner.decode_layers = counting  # type: ignore[assignment]
        apart = make_engine(tiny_llama, dtype="bfloat16")
        apart.runner.decode_layers = None
        got, want = tokens_and_logprobs(fused, prompts, params), tokens_and_logprobs(apart, prompts, params)
        assert counting.steps >= 20  # the decode steps took it; the prompts' steps did not
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
            assert tokens == want_tokens
            assert logprobs == want_logprobs  # exact: the same arithmetic in the same order

    def test_a_run_of_layers_continues_where_the_last_one_stopped(self, tiny_llama: Path) -> None:
        """A pipeline stage computes a range of the layers: two ranges in turn are the whole run."""
        engine = make_engine(tiny_llama, dtype="bfloat16")
        for index, prompt in enumerate(random_prompts(1000, [21, 9, 50], seed=2)):
            engine.add_request(f"r{index}", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        while engine.scheduler.waiting or any(seq.num_uncomputed > 1 for seq in engine.scheduler.running):
            engine.step()
        runner, layers = engine.runner, engine.runner.decode_layers
        assert layers is not None
        ids, positions, batch, _ = runner._batch(engine.scheduler.schedule())
        assert batch.decode is not None and batch.decode.rows.shape[0] == 3
        hidden = runner.decoder.embed_tokens(ids)
        cos, sin = (t[0] for t in runner.decoder.rotary_emb(hidden[None], positions[None]))
        count = len(runner.layers)
        whole = layers(hidden, cos, sin, batch, range(count))
        first = layers(hidden, cos, sin, batch, range(1))  # the K and V it stores are the ones stored already
        assert whole is not None and first is not None and not torch.equal(first, whole)
        assert torch.equal(layers(first, cos, sin, batch, range(1, count)), whole)


class TestWhenItIsTaken:
    @pytest.mark.usefixtures("linear_kernel_everywhere")
    def test_a_step_whose_hooks_have_work_keeps_the_layers_apart(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama, dtype="bfloat16")
        assert engine.runner.decode_layers is not None
        counting = CountingLayers(engine.runner.decode_layers)
        engine.runner.decode_layers = counting  # type: ignore[assignment]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        streamed: list[int] = []
        engine.layer_export.watch("r0", 0, lambda layer, payloads: streamed.append(layer))
        tokens_and_logprobs(engine, random_prompts(1000, [20], seed=1), params)
        assert counting.steps == 0 and len(streamed) == 6 * len(engine.runner.layers)  # every step's every layer
        engine.layer_export.forget("r0")
        tokens_and_logprobs(engine, random_prompts(1000, [20], seed=1), params)
        assert counting.steps == 5  # the steps after the prompt's

    def test_an_import_pending_is_work(self) -> None:
        hook = LayerImport()
        assert hook.idle([])
        hook.expect(None, [0], 0)  # type: ignore[arg-type]
        assert not hook.idle([])

    def test_float32_and_a_switched_off_kernel_keep_the_layers_apart(self, tiny_llama: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
        assert make_engine(tiny_llama, dtype="float32").runner.decode_layers is None
        monkeypatch.setenv("HALFMOON_DECODE_LAYERS_KERNEL", "0")
        native.loaded.cache_clear()
        try:
            assert make_engine(tiny_llama, dtype="bfloat16").runner.decode_layers is None
        finally:
            native.loaded.cache_clear()

