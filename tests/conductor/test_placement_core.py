"""The conductor's pure core: the instance table and the least-loaded policy."""

from __future__ import annotations

import pytest
from halfmoon.protocol import Heartbeat, Load, RejectReason, Role, SamplingParams, ScheduleRequest
from halfmoon.services.conductor.kv_index import LiveBlockIndex
from halfmoon.services.conductor.placement import LeastLoaded, Placement, Rejection
from halfmoon.services.conductor.registry import InstanceTable

REQUEST = ScheduleRequest(request_id="r", model="m", prompt_len=4, sampling=SamplingParams(), deadline=0.0)


def hb(iid: str, role: Role = Role.PREFILL, interval: float = 0.1, draining: bool = False, **load) -> Heartbeat:
    return Heartbeat(
        instance_id=iid,
        role=role,
        address=iid,
        load=Load(**load),
        timestamp=0.0,
        interval_s=interval,
        draining=draining,
    )


class TestInstanceTable:
    def test_silent_past_deadline_is_expired_once(self):
        table = InstanceTable(timeout_s=1.0)
        assert table.observe(hb("a"), now=0.0) is True
        assert table.observe(hb("b"), now=0.5) is True
        assert table.expire(now=1.2) and "a" not in table and "b" in table
        assert table.expire(now=1.3) == []

    def test_heartbeat_refreshes_and_resets_assignments(self):
        table = InstanceTable(timeout_s=1.0)
        table.observe(hb("a"), now=0.0)
        table.note_assigned("a")
        assert table.get("a").assigned == 1
        assert table.observe(hb("a", queue_len=3), now=0.9) is False
        assert table.get("a").assigned == 0 and table.get("a").load.queue_len == 3
        assert table.expire(now=1.5) == []

    def test_slow_heartbeaters_get_three_intervals(self):
        table = InstanceTable(timeout_s=1.0)
        table.observe(hb("slow", interval=2.0), now=0.0)
        assert table.expire(now=5.9) == []
        assert [v.instance_id for v in table.expire(now=6.1)] == ["slow"]

    def test_candidates_filter_role_and_draining(self):
        table = InstanceTable(timeout_s=1.0)
        table.observe(hb("p1"), 0.0)
        table.observe(hb("p0", draining=True), 0.0)
        table.observe(hb("d0", role=Role.DECODE), 0.0)
        assert [v.instance_id for v in table.candidates(Role.PREFILL)] == ["p1"]
        assert [v.instance_id for v in table.candidates(Role.DECODE)] == ["d0"]

    def test_timeout_must_be_positive(self):
        with pytest.raises(ValueError):
            InstanceTable(timeout_s=0)


class TestLeastLoaded:
    def views(self, *beats: Heartbeat):
        table = InstanceTable(timeout_s=1.0)
        for beat in beats:
            table.observe(beat, 0.0)
        return table, table.candidates(Role.PREFILL), table.candidates(Role.DECODE)

    def test_picks_fewest_pending_on_each_side(self):
        _, p, d = self.views(
            hb("p0", queue_len=3),
            hb("p1", running=1),
            hb("d0", role=Role.DECODE, running=9),
            hb("d1", role=Role.DECODE, running=2),
        )
        assert LeastLoaded().place(REQUEST, p, d) == Placement("p1", "d1")

    def test_decode_tie_goes_to_more_free_kv(self):
        _, p, d = self.views(
            hb("p0"), hb("d0", role=Role.DECODE, free_kv_blocks=5), hb("d1", role=Role.DECODE, free_kv_blocks=50)
        )
        assert LeastLoaded().place(REQUEST, p, d).decode == "d1"

    def test_assignments_since_heartbeat_spread_a_burst(self):
        table, _, _ = self.views(hb("p0"), hb("p1"), hb("d0", role=Role.DECODE))
        chosen = []
        for _ in range(4):
            choice = LeastLoaded().place(REQUEST, table.candidates(Role.PREFILL), table.candidates(Role.DECODE))
            table.note_assigned(choice.prefill)
            chosen.append(choice.prefill)
        assert sorted(chosen) == ["p0", "p0", "p1", "p1"]

    @pytest.mark.parametrize(
        ("beats", "reason"),
        [
            ((), RejectReason.NO_PREFILL_INSTANCE),
            ((hb("d0", role=Role.DECODE),), RejectReason.NO_PREFILL_INSTANCE),
            ((hb("p0"),), RejectReason.NO_DECODE_INSTANCE),
        ],
    )
    def test_rejects_when_a_role_is_missing(self, beats, reason):
        _, p, d = self.views(*beats)
        result = LeastLoaded().place(REQUEST, p, d)
        assert isinstance(result, Rejection) and result.reason is reason and result.message


class TestLiveBlockIndexMatch:
    def test_counts_leading_blocks_any_instance_holds(self):
        index = LiveBlockIndex()
        index.apply("p0", [b"k0", b"k1"], [])
        index.apply("p1", [b"k2"], [])
        assert index.match([b"k0", b"k1", b"k2", b"k3"]) == 3
        index.apply("p1", [], [b"k2"])
        assert index.match([b"k0", b"k1", b"k2"]) == 2
        index.forget("p0")
        assert index.match([b"k0"]) == 0
