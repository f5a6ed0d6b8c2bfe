"""Incremental detokenising with stop strings: one implementation for the engine and the gateway."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol


class Decoder(Protocol):
    """The part of a tokenizer detokenising needs (transformers tokenizers have it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


class TextDelta(NamedTuple):
    text: str
    stopped: bool


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, in time independent of the output length.

    Each push decodes only a short window: the ids from ``prefix`` to the end, against the
    same window up to ``read`` (ids already turned into text), so a tokenizer that merges
    tokens across the boundary still gets the context it needs. Text that ends in an
    incomplete UTF-8 character (U+FFFD), or that could still become a stop string, is held
    back until it is settled; a stop string ends the output before it. Starting from
    ``initial_ids`` reproduces the exact state another process reached with the same tokens,
    so prefill and decode instances emit one seamless stream.
    """

    def __init__(self, tokenizer: Decoder | None, stop: tuple[str, ...] = (), initial_ids: Iterable[int] = ()) -> None:
        self._tok = tokenizer
        self.stop = stop
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are in ``text``
        self.text = ""  # settled text (stops cut it short)
        self.emitted = 0  # characters of ``text`` already handed out
        for token in initial_ids:
            self.push((token,))

    def _decode(self, start: int, end: int) -> str:
        assert self._tok is not None
        text = self._tok.decode(self._ids[start:end], skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text

    def _settle(self, force: bool) -> None:
        """Move newly decoded window text into ``text``; ``force`` takes a dangling partial character too."""
        if self._tok is None or self._read == len(self._ids):
            return
        before = self._decode(self._prefix, self._read)
        window = self._decode(self._prefix, len(self._ids))
        if not force and (window.endswith("\ufffd") or len(window) <= len(before)):
            return
        self.text += window[len(before):]
        self._prefix, self._read = self._read, len(self._ids)

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        self._ids.extend(token_ids)
        self._settle(force=False)
        text = self.text
        for stop in self.stop:
            found = text.find(stop, max(0, self.emitted - len(stop) + 1))
            if found >= 0:
                delta = text[self.emitted:found]
                self.text = text[:found]
                self.emitted = found
                return TextDelta(delta, True)
        hold = max((k for stop in self.stop for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        upto = max(self.emitted, len(text) - hold)
        delta = text[self.emitted:upto]
        self.emitted = upto
        return TextDelta(delta, False)

    def flush(self) -> str:
        """All text not yet emitted, once the output is over for another reason (a dangling partial
        character comes out as U+FFFD, as a one-shot decode would give it)."""
        self._settle(force=True)
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta
