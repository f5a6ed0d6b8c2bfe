"""Each request's share of the engine's steps (the prefill cost samples the conductor fits)."""

from __future__ import annotations

from pathlib import Path

import pytest

from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine, random_prompts

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


class TestComputeShare:
    def test_prompts_computed_in_one_step_share_it_by_tokens(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama)
        long, short = random_prompts(engine.vocab_size, [24, 8], seed=5)
        engine.add_request("long", long, GREEDY)
        engine.add_request("short", short, GREEDY)
        first = {out.request_id: out for out in engine.step()}  # 32 tokens: both prompts in one step
        assert first.keys() == {"long", "short"}
        assert first["short"].compute_s > 0
        assert first["long"].compute_s == pytest.approx(3 * first["short"].compute_s)

    def test_the_share_only_grows_as_the_request_decodes(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama)
        (prompt,) = random_prompts(engine.vocab_size, [20], seed=6)
        engine.add_request("r", prompt, GREEDY)
        shares = []
        while engine.has_unfinished():
            shares += [out.compute_s for out in engine.step()]
        assert len(shares) == 3 and shares[0] > 0 and shares == sorted(shares) and shares[2] > shares[0]
