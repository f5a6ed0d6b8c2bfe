"""Following one request across attempts: order, duplicates, stale attempts, the migration budget."""

from __future__ import annotations

import pytest

from halfmoon.protocol import TokenEvent
from halfmoon.services.gateway.attempts import Recovery, StreamOrder


def ev(index: int, *tokens: int, attempt: int = 0) -> TokenEvent:
    return TokenEvent(request_id="r", index=index, token_ids=tokens or (index + 100,), attempt=attempt)


class TestStreamOrder:
    def test_out_of_order_events_wait_for_the_gap(self):
        order = StreamOrder()
        assert order.accept(ev(1)) == ([], True)  # decode's first beat prefill's index 0
        ready, gap = order.accept(ev(0))
        assert [e.index for e in ready] == [0, 1] and not gap
        assert order.tokens == [100, 101]

    def test_repeats_are_dropped(self):
        order = StreamOrder()
        order.accept(ev(0))
        order.accept(ev(1))
        assert order.accept(ev(1)) == ([], False)  # a re-send after a resume request
        assert order.accept(ev(0)) == ([], False)

    def test_a_stalled_attempt_that_wakes_up_adds_nothing(self):
        order = StreamOrder()
        order.accept(ev(0))
        order.accept(ev(1))
        order.next_attempt()
        assert not order.attempt_delivered
        assert order.accept(ev(2, attempt=0)) == ([], False)
        ready, _ = order.accept(ev(2, 7, attempt=1))
        assert [e.token_ids for e in ready] == [(7,)] and order.tokens == [100, 101, 7]
        assert order.attempt_delivered


class TestRecovery:
    def test_budget_and_avoided_instances(self):
        recovery = Recovery(limit=2)
        assert recovery.allow(("decode-0",)) and recovery.allow(("prefill-1", ""))
        assert not recovery.allow(("decode-1",))
        assert recovery.used == 2 and recovery.excluded == {"decode-0", "prefill-1"}

    def test_zero_means_never(self):
        assert not Recovery(limit=0).allow(())
        with pytest.raises(ValueError):
            Recovery(limit=-1)
