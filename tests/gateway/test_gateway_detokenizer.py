"""Incremental detokenising: deltas add up to the full text and never split a character."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from halfmoon.core.detokenizer import IncrementalDetokenizer as Detokenizer

SAMPLES = ["plain ascii words", "héllo wörld", "世界 moon 🌙🌕 ok", "mixed 1234 — dash … ellipsis ✓", "🌙" * 5]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class TestDetokenizer:
    @pytest.mark.parametrize("text", SAMPLES)
    @pytest.mark.parametrize("step", [1, 2, 3])
    def test_deltas_concatenate_to_the_text(self, tokenizer, text, step):
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = Detokenizer(tokenizer)
        deltas = [detok.push(ids[i : i + step]).text for i in range(0, len(ids), step)] + [detok.flush()]
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)

    def test_multibyte_character_is_held_until_complete(self, tokenizer):
        ids = tokenizer.encode("🌙", add_special_tokens=False)
        assert len(ids) > 1  # the tiny tokenizer splits it into byte tokens
        detok = Detokenizer(tokenizer)
        assert [detok.push([t]).text for t in ids[:-1]] == [""] * (len(ids) - 1)
        assert detok.push(ids[-1:]).text == "🌙"

    def test_special_tokens_produce_no_text(self, tokenizer):
        detok = Detokenizer(tokenizer)
        assert detok.push(tokenizer.encode("ok", add_special_tokens=False)).text == "ok"
        assert detok.push([tokenizer.eos_token_id]).text == ""
        assert detok.flush() == ""

    def test_dangling_partial_character_surfaces_on_flush(self, tokenizer):
        ids = tokenizer.encode("a🌙", add_special_tokens=False)
        detok = Detokenizer(tokenizer)
        assert detok.push(ids[:-1]).text == ""  # held: it ends inside a character
        assert detok.flush() == "a\ufffd"  # the output really ended mid-character

    def test_random_token_streams_match_one_shot_decoding(self, tokenizer):
        rng = random.Random(0)
        for _ in range(50):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
            detok = Detokenizer(tokenizer)
            text = "".join(detok.push([t]).text for t in ids) + detok.flush()
            assert text == tokenizer.decode(ids, skip_special_tokens=True)
