"""The last stream events of each request an instance serves, to re-send after a NATS outage.

Core NATS drops what is published while a subscriber is away (a server restart of a few
seconds, a reconnect), so a requester that sees a gap asks the publisher to resume from an
index; the publisher re-sends what it still holds. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

from halfmoon.protocol.stream import ErrorEvent, TokenEvent

StreamEvent = TokenEvent | ErrorEvent


class _Stream(NamedTuple):
    subject: str
    attempt: int
    events: collections.deque[StreamEvent]
    last: list[float]  # [time of the last event], mutable in place


class ReplayBuffer:
    """Per request: its stream subject, attempt and last ``per_request`` events, kept ``keep_s``
    seconds after the last one (a finished request's final event may be the one lost)."""

    def __init__(self, per_request: int = 256, keep_s: float = 60.0) -> None:
        if per_request < 1 or keep_s <= 0:
            raise ValueError(f"need per_request >= 1 and keep_s > 0, got {per_request}, {keep_s}")
        self.per_request, self.keep_s = per_request, keep_s
        self._streams: dict[str, _Stream] = {}
        self._pruned = 0.0

    def record(self, subject: str, event: StreamEvent, now: float) -> None:
        stream = self._streams.get(event.request_id)
        if stream is None or stream.attempt != event.attempt:
            stream = _Stream(subject, event.attempt, collections.deque(maxlen=self.per_request), [now])
            self._streams[event.request_id] = stream
        stream.events.append(event)
        stream.last[0] = now
        self._prune(now)

    def holds(self, request_id: str, attempt: int) -> bool:
        stream = self._streams.get(request_id)
        return stream is not None and stream.attempt == attempt

    def since(self, request_id: str, attempt: int, from_index: int) -> tuple[str, list[StreamEvent]] | None:
        """(subject, events reaching ``from_index`` or later); None when the buffer does not reach back
        that far (events before it were dropped) or holds nothing of this attempt."""
        stream = self._streams.get(request_id)
        if stream is None or stream.attempt != attempt:
            return None
        tokens = [e for e in stream.events if isinstance(e, TokenEvent)]
        if tokens and tokens[0].index > from_index and len(tokens) == self.per_request:
            return None  # the events between from_index and the oldest kept one are gone
        reaching = [e for e in stream.events
                    if isinstance(e, ErrorEvent) or e.index + max(1, len(e.token_ids)) > from_index]
        return stream.subject, reaching

    def _prune(self, now: float) -> None:
        if now - self._pruned < 1.0:
            return
        self._pruned = now
        stale = [rid for rid, s in self._streams.items() if now - s.last[0] > self.keep_s]
        for rid in stale:
            del self._streams[rid]
