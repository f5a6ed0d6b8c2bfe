"""The launcher's restart policy as a pure function of exit times: backoff, reset, crash loop, when
each restart is due."""

from __future__ import annotations

import pytest

from halfmoon.deploy.supervisor import CrashLoop, RestartPolicy, Supervision
from halfmoon.protocol.registry import Leaving


def supervision(**policy: float) -> Supervision:
    return Supervision(RestartPolicy(**{"backoff_s": 0.5, "max_backoff_s": 4.0, "stable_after_s": 30.0,
                                        "crash_loop_exits": 5, "crash_loop_window_s": 60.0, **policy}))


class TestBackoff:
    def test_doubles_for_exits_in_a_row_up_to_the_cap(self) -> None:
        sup, delays, now = supervision(crash_loop_exits=100), [], 0.0
        for _ in range(6):
            sup.started("decode-0", now)
            now += 1.0
            delays.append(sup.exited("decode-0", now))
        assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
        assert sup.restarts("decode-0") == 6

    def test_a_stable_run_starts_the_count_again(self) -> None:
        sup = supervision()
        sup.started("decode-0", 0.0)
        assert sup.exited("decode-0", 1.0) == 0.5
        sup.started("decode-0", 1.5)
        assert sup.exited("decode-0", 2.0) == 1.0
        sup.started("decode-0", 3.0)
        assert sup.exited("decode-0", 40.0) == 0.5  # ran 37 s: healthy again

    def test_processes_are_counted_apart(self) -> None:
        sup = supervision()
        for name in ("decode-0", "nats"):
            sup.started(name, 0.0)
        assert sup.exited("decode-0", 1.0) == 0.5
        assert sup.exited("nats", 1.0) == 0.5
        assert sup.restarts("prefill-0") == 0


class TestRestartSchedule:
    def test_each_restart_is_due_once_its_backoff_has_passed_in_the_order_they_exited(self) -> None:
        sup = supervision()
        for name in ("decode-0", "nats"):
            sup.started(name, 0.0)
        assert sup.exited("decode-0", 1.0) == 0.5 and sup.exited("nats", 1.2) == 0.5
        assert sup.awaiting_restart("decode-0") and sup.due(1.4) == []
        assert sup.due(1.7) == ["decode-0", "nats"]
        assert not sup.awaiting_restart("decode-0") and sup.due(100.0) == []

    def test_a_process_asked_to_stop_while_waiting_is_not_restarted(self) -> None:
        sup = supervision()
        sup.started("prefill-0", 0.0)
        sup.exited("prefill-0", 1.0)
        sup.stopping("prefill-0")
        assert not sup.awaiting_restart("prefill-0") and sup.due(100.0) == []


class TestCrashLoop:
    def test_five_exits_within_the_window_back_off_for_minutes_and_it_is_leaving(self) -> None:
        sup = supervision()
        answers = []
        for i in range(5):
            sup.started("cache-manager-0", i * 10.0)
            answers.append(sup.exited("cache-manager-0", i * 10.0 + 1))
        assert answers == [0.5, 1.0, 2.0, 4.0, 300.0]
        assert sup.leaving("cache-manager-0", 41.0) is Leaving.CRASH_LOOPING
        assert sup.leaving("decode-0", 41.0) is None  # the others are not touched

    def test_a_crash_loop_ends_once_its_window_holds_fewer_exits(self) -> None:
        sup = supervision()
        for i in range(5):
            sup.started("gateway-0", float(i))
            sup.exited("gateway-0", i + 0.5)
        assert sup.leaving("gateway-0", 10.0) is Leaving.CRASH_LOOPING
        assert sup.leaving("gateway-0", 61.0) is None  # the first exit left the 60 s window

    def test_exits_spread_wider_than_the_window_never_do(self) -> None:
        sup = supervision()
        for i in range(20):
            sup.started("decode-0", i * 20.0)
            assert sup.exited("decode-0", i * 20.0 + 1) <= 4.0
            assert sup.leaving("decode-0", i * 20.0 + 1) is None

    def test_a_process_asked_to_stop_is_draining_even_when_crash_looping(self) -> None:
        sup = supervision()
        for i in range(5):
            sup.started("prefill-0", float(i))
            sup.exited("prefill-0", i + 0.5)
        sup.stopping("prefill-0")
        assert sup.leaving("prefill-0", 5.0) is Leaving.DRAINING

    def test_the_message_names_the_process_and_its_last_lines(self) -> None:
        message = str(CrashLoop("gateway-0", 5, 60.0, ["OSError: address already in use"]))
        assert "gateway-0" in message and "5 exits within 60s" in message and "address already in use" in message

    def test_bad_policies_are_refused(self) -> None:
        with pytest.raises(ValueError):
            RestartPolicy(backoff_s=0)
        with pytest.raises(ValueError):
            RestartPolicy(crash_loop_exits=0)
