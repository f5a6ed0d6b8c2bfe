"""The pure part of following one request across attempts: stream order and the migration budget."""

from __future__ import annotations

from typing import NamedTuple

from halfmoon.protocol.base import ErrorCode
from halfmoon.protocol.stream import TokenEvent


class GenerationError(Exception):
    def __init__(self, code: ErrorCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class Lost(NamedTuple):
    """Attempt ``attempt`` cannot finish: why, as what error, and the instances to avoid next time."""

    attempt: int
    message: str
    code: ErrorCode
    instances: tuple[str, ...]


class StreamOrder:
    """Puts one request's TokenEvents in output order, each index once, from the current attempt only.

    Contract: ``tokens`` are the token ids delivered so far (a migration resumes after them);
    ``accept`` returns the events now deliverable in order, and whether a gap holds back later
    ones; events of other attempts and indexes already delivered are dropped.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.attempt = 0
        self.attempt_delivered = False  # the current attempt has streamed something
        self._early: dict[int, TokenEvent] = {}

    def accept(self, event: TokenEvent) -> tuple[list[TokenEvent], bool]:
        if event.attempt != self.attempt or event.index < len(self.tokens):
            return [], bool(self._early)
        self._early[event.index] = event
        ready = []
        while (head := self._early.pop(len(self.tokens), None)) is not None:
            self.tokens.extend(head.token_ids)
            ready.append(head)
        self.attempt_delivered = self.attempt_delivered or bool(ready)
        return ready, bool(self._early)

    def next_attempt(self) -> None:
        self.attempt += 1
        self.attempt_delivered = False
        self._early.clear()


class Recovery:
    """The migration budget of one request and the instances that failed it."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"migration limit must be >= 0, got {limit}")
        self.limit = limit
        self.used = 0
        self.excluded: set[str] = set()

    def exclude(self, instance_id: str) -> None:
        self.excluded.add(instance_id)

    def allow(self, failed: tuple[str, ...]) -> bool:
        """Spend one migration (avoiding ``failed`` from now on); False when none is left."""
        if self.used >= self.limit:
            return False
        self.used += 1
        self.excluded.update(i for i in failed if i)
        return True
