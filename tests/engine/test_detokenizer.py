"""Streaming text never splits a character and never leaks part of a stop string."""

from __future__ import annotations

import pytest

from halfmoon.cli.model_tools import train_tokenizer
from halfmoon.core.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(vocab_size=600)


class TestIncrementalText:
    def test_multibyte_characters_arrive_whole(self, tokenizer) -> None:
        text = "half moon 🌙 über naïve 東京 done"
        ids = tokenizer.encode(text)
        detok = IncrementalDetokenizer(tokenizer, (), [])
        deltas = [detok.push((i,)).text for i in ids]
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) + detok.flush() == text
        assert len(ids) > len(text.split())  # the emoji and CJK really span several tokens

    def test_stop_string_across_tokens_is_cut(self, tokenizer) -> None:
        ids = tokenizer.encode("the cache block moves to the decode node")
        detok = IncrementalDetokenizer(tokenizer, ("to the",), [])
        emitted, stopped = "", False
        for token in ids:
            delta = detok.push((token,))
            emitted += delta.text
            if delta.stopped:
                stopped = True
                break
        assert stopped and emitted == "the cache block moves "

    def test_restart_from_initial_ids_continues_the_stream(self, tokenizer) -> None:
        ids = tokenizer.encode("prefill hands 🌙 to decode")
        whole = IncrementalDetokenizer(tokenizer, ("xyz",), [])
        first_part = "".join(whole.push((t,)).text for t in ids[:4])
        resumed = IncrementalDetokenizer(tokenizer, ("xyz",), ids[:4])
        rest = "".join(resumed.push((t,)).text for t in ids[4:]) + resumed.flush()
        assert first_part + rest == "prefill hands 🌙 to decode"
