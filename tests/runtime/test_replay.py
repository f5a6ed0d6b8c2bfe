"""The publisher's replay buffer: what a ResumeRequest gets back."""

from __future__ import annotations

import pytest

from halfmoon.protocol import ErrorCode, ErrorEvent, TokenEvent
from halfmoon.runtime.replay import ReplayBuffer


def ev(index: int, attempt: int = 0, rid: str = "r") -> TokenEvent:
    return TokenEvent(request_id=rid, index=index, token_ids=(index,), attempt=attempt)


class TestReplayBuffer:
    def test_resends_from_the_index_asked(self):
        buf = ReplayBuffer(per_request=8)
        for i in range(1, 6):
            buf.record("s.r", ev(i), now=0.0)
        subject, events = buf.since("r", 0, 3)
        assert subject == "s.r" and [e.index for e in events] == [3, 4, 5]

    def test_error_events_are_resent_too(self):
        buf = ReplayBuffer()
        buf.record("s.r", ev(1), now=0.0)
        buf.record("s.r", ErrorEvent(request_id="r", code=ErrorCode.INTERNAL, message="x"), now=0.0)
        assert isinstance(buf.since("r", 0, 2)[1][-1], ErrorEvent)

    def test_nothing_when_the_oldest_kept_is_past_the_index(self):
        buf = ReplayBuffer(per_request=3)
        for i in range(1, 10):
            buf.record("s.r", ev(i), now=0.0)
        assert buf.since("r", 0, 2) is None
        assert [e.index for e in buf.since("r", 0, 7)[1]] == [7, 8, 9]

    def test_a_newer_attempt_replaces_the_old_one(self):
        buf = ReplayBuffer()
        buf.record("s.r", ev(1), now=0.0)
        buf.record("s.r", ev(4, attempt=1), now=0.0)
        assert buf.since("r", 0, 0) is None and buf.holds("r", 1) and not buf.holds("r", 0)

    def test_forgets_after_keep_s(self):
        buf = ReplayBuffer(keep_s=10.0)
        buf.record("s.a", ev(1, rid="a"), now=0.0)
        buf.record("s.b", ev(1, rid="b"), now=11.0)
        assert not buf.holds("a", 0) and buf.holds("b", 0)
        with pytest.raises(ValueError):
            ReplayBuffer(per_request=0)
