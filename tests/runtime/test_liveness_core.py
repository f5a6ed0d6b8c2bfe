"""NatsLiveness on a fake clock: when a service counts as unhealthy, and when it gives up."""

from __future__ import annotations

import pytest

from halfmoon.runtime.liveness import NatsLiveness


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TestDeadlines:
    def test_healthy_through_a_brief_outage(self) -> None:
        clock = Clock()
        live = NatsLiveness(10.0, 60.0, clock)
        live.lost()
        clock.now += 9.9
        assert live.healthy() and not live.given_up() and not live.connected
        live.back()
        clock.now += 100
        assert live.healthy() and not live.given_up() and live.status() == (True, "ok")
        assert live.outages == 1

    def test_unhealthy_past_the_deadline_then_given_up(self) -> None:
        clock = Clock()
        live = NatsLiveness(10.0, 60.0, clock)
        live.lost()
        clock.now += 10.0
        ok, reason = live.status()
        assert not ok and "NATS unreachable for 10.0s" in reason and not live.given_up()
        clock.now += 50.0
        assert live.given_up()

    def test_a_second_disconnect_callback_keeps_the_first_time(self) -> None:
        clock = Clock()
        live = NatsLiveness(10.0, 60.0, clock)
        live.lost()
        clock.now += 8
        live.lost()
        clock.now += 3
        assert not live.healthy()

    def test_deadlines_must_be_ordered(self) -> None:
        with pytest.raises(ValueError):
            NatsLiveness(10.0, 5.0)
