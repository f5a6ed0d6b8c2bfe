"""Incremental detokenisation with stop strings, safe for multi-byte characters."""

from __future__ import annotations

from typing import NamedTuple

from transformers import PreTrainedTokenizerBase


class TextDelta(NamedTuple):
    text: str
    stopped: bool


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Text that could still become a stop string, or that ends in an incomplete UTF-8
    character, is held back until it is settled; a stop string ends the output before
    it. Starting from ``initial_ids`` reproduces the exact state another engine reached
    with the same tokens, so prefill and decode instances emit one seamless stream.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stop: tuple[str, ...],
                 initial_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        for token in initial_ids:
            self.push(token)

    def _decode(self) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, token_id: int) -> TextDelta:
        self.ids.append(token_id)
        self.text = self._decode()
        stable = self.text[:-1] if self.text.endswith("\ufffd") else self.text
        for stop in self.stop:
            found = stable.find(stop, max(0, self.emitted - len(stop) + 1))
            if found >= 0:
                delta = stable[self.emitted:found]
                self.emitted = found
                self.text = stable[:found]
                return TextDelta(delta, True)
        hold = max((k for stop in self.stop for k in range(1, len(stop))
                    if stable.endswith(stop[:k])), default=0)
        upto = max(self.emitted, len(stable) - hold)
        delta = stable[self.emitted:upto]
        self.emitted = upto
        return TextDelta(delta, False)

    def flush(self) -> str:
        """All text not yet emitted, once the output is over for another reason."""
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta
