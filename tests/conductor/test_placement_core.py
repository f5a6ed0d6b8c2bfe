"""The conductor's pure core: the instance table and the least-loaded policy."""

from __future__ import annotations

import msgspec
import pytest
from fake_instances import SPEC

from halfmoon.policy.ledger import Cleared, Outstanding, Stage, WorkLedger
from halfmoon.protocol import (
    Heartbeat,
    Load,
    Placed,
    RejectReason,
    Role,
    SamplingParams,
    ScheduleRequest,
)
from halfmoon.protocol.registry import Leaving
from halfmoon.protocol.work import WorkDone, WorkOutcome
from halfmoon.services.conductor.kv_index import LiveBlockIndex
from halfmoon.services.conductor.placement import (
    LeastLoaded,
    Placement,
    Rejection,
    place_pair,
)
from halfmoon.services.conductor.policy_config import PolicySettings, build_placement
from halfmoon.services.conductor.registry import InstanceTable, InstanceView
from halfmoon.services.conductor.service import FirstTokenWatch, placement_stages

REQUEST = ScheduleRequest(request_id="r", model="m", prompt_len=4, sampling=SamplingParams(), deadline=0.0)


def hb(iid: str, role: Role = Role.PREFILL, interval: float = 0.1, draining: bool = False, **load) -> Heartbeat:
    return Heartbeat(
        instance_id=iid,
        role=role,
        address=iid,
        load=Load(**load),
        timestamp=0.0,
        interval_s=interval,
        leaving=Leaving.DRAINING if draining else None,
    )


class TestInstanceTable:
    def test_silent_past_deadline_is_expired_once(self):
        table = InstanceTable(timeout_s=1.0)
        assert table.observe(hb("a"), now=0.0) is True
        assert table.observe(hb("b"), now=0.5) is True
        assert table.expire(now=1.2) and "a" not in table and "b" in table
        assert table.expire(now=1.3) == []

    def test_heartbeat_refreshes_liveness_and_load(self):
        table = InstanceTable(timeout_s=1.0)
        table.observe(hb("a"), now=0.0)
        assert table.observe(hb("a", queue_len=3), now=0.9) is False
        assert table.get("a").load.queue_len == 3 and table.get("a").pending == 3
        assert table.expire(now=1.5) == []

    def test_requests_reported_done_leave_the_batch_until_the_next_heartbeat(self):
        table = InstanceTable(timeout_s=1.0)
        table.observe(hb("a", role=Role.AGGREGATED, running=8), now=0.0)
        for _ in range(8):  # a wave of 8 streams ended together
            table.request_left("a")
        assert table.get("a").running == 0 and table.get("a").pending == 0
        table.request_left("a")  # a heartbeat that already counted it out: never below none
        assert table.get("a").running == 0
        table.observe(hb("a", role=Role.AGGREGATED, running=3), now=0.5)
        assert table.get("a").running == 3
        table.request_left("gone")  # an instance it no longer lists

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

    def test_placements_in_the_ledger_spread_a_burst(self):
        table, _, _ = self.views(hb("p0"), hb("p1"), hb("d0", role=Role.DECODE))
        ledger = WorkLedger()

        def views(role: Role) -> list[InstanceView]:
            return [v._replace(outstanding=ledger.outstanding(v.instance_id)) for v in table.candidates(role)]

        chosen = []
        for i in range(4):
            choice = LeastLoaded().place(REQUEST, views(Role.PREFILL), views(Role.DECODE))
            ledger.place(f"r{i}", [Stage(choice.prefill, 0, 60.0), Stage(choice.decode, 1, 60.0)], now=0.0)
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


class TestLedgerAcrossConductors:
    """Two conductors hold the same entries: their own placements and, via Placed, the other's."""

    def test_both_ledgers_agree_and_drain_alike(self):
        a, b = WorkLedger(grace_s=1.0), WorkLedger(grace_s=1.0)
        for i in range(4):
            placed = Placed(conductor="c0", prefill_instance="p0", decode_instance="d0", request_id=f"r{i}",
                            prefill_s=0.5, prompt_tokens=10)
            for ledger in (a, b):  # c0 places, c1 hears the Placed note
                ledger.place(placed.request_id, placement_stages(placed, now=0.0), now=0.0)
        assert a.outstanding("p0") == b.outstanding("p0") == Outstanding(4, 2.0, 40, 4)
        for ledger in (a, b):
            ledger.done("r0", "p0", Cleared.COMPLETED, now=0.5)  # WorkDone reaches every conductor
            ledger.end("r1", now=0.5)  # so does a cancellation
            ledger.reconcile("p0", held=1, now=2.0)  # r2 never reached p0
        assert a.outstanding("p0") == b.outstanding("p0") == Outstanding(1, 0.5, 10, 1)
        assert a.stages("r3") == b.stages("r3")

    def test_placed_note_sets_the_deadlines(self):
        placed = Placed(conductor="c0", prefill_instance="p0", decode_instance="d0", request_id="r", ttl_s=5.0,
                        decode_ttl_s=9.0)
        prefill, decode = placement_stages(placed, now=10.0)
        assert (prefill.instance_id, prefill.order, prefill.expires_at) == ("p0", 0, 15.0)
        assert (decode.instance_id, decode.order, decode.expires_at) == ("d0", 1, 19.0)
        assert not prefill.paced
        paced, _ = placement_stages(msgspec.structs.replace(placed, paced=True), now=10.0)
        assert paced.paced


class TestCutOff:
    def test_cut_off_conductor_holds_everyone(self):
        table = InstanceTable(timeout_s=1.0)
        table.observe(hb("d0", role=Role.DECODE), now=0.0)
        table.hold(now=5.0)  # NATS was away until 5.0
        assert table.expire(now=5.5) == []
        assert [v.instance_id for v in table.expire(now=6.1)] == ["d0"]


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


class TestAggregatedPlacement:
    """Aggregated instances take both phases where no prefill/decode pair is live."""

    def test_only_aggregated_instances_place_both_phases_on_one(self):
        table = InstanceTable(timeout_s=1.0)
        for beat in (hb("a0", role=Role.AGGREGATED, running=2), hb("a1", role=Role.AGGREGATED)):
            table.observe(beat, 0.0)
        aggregated = table.candidates(Role.AGGREGATED)
        assert place_pair(LeastLoaded(), REQUEST, [], [], aggregated, now=0.0) == Placement("a1", "a1")

    def test_least_loaded_serves_whole_where_the_aggregated_instance_holds_less_and_nothing_live_is_rejected(self):
        table = InstanceTable(timeout_s=1.0)
        for beat in (hb("p0"), hb("d0", role=Role.DECODE), hb("a0", role=Role.AGGREGATED, running=1)):
            table.observe(beat, 0.0)
        views = [table.candidates(role) for role in (Role.PREFILL, Role.DECODE, Role.AGGREGATED)]
        assert place_pair(LeastLoaded(), REQUEST, *views, now=0.0) == Placement("p0", "d0")
        table.observe(hb("d0", role=Role.DECODE, running=2), 0.0)
        views = [table.candidates(role) for role in (Role.PREFILL, Role.DECODE, Role.AGGREGATED)]
        assert place_pair(LeastLoaded(), REQUEST, *views, now=0.0) == Placement("a0", "a0")
        result = place_pair(LeastLoaded(), REQUEST, [], [], [], now=0.0)
        assert isinstance(result, Rejection) and result.reason is RejectReason.NO_PREFILL_INSTANCE


class TestPerRequestDisaggregation:
    """With a pair and an aggregated instance live, the KV-centric placement hands off or serves whole by
    predicted cost (policy/disaggregation.py): here 1 ms a prompt token, a 20 ms hand-off, a batch of 4."""

    SETTINGS = PolicySettings(prefill_tokens_per_s=1000.0, ttft_slo_s=60.0, tbt_slo_s=5.0, handoff_overhead_s=0.02)

    def views(self) -> list[list[InstanceView]]:
        load = Load(running=4, total_kv_blocks=1000, free_kv_blocks=900)
        return [[InstanceView("p0", Role.PREFILL, "p0", Load(), None)],
                [InstanceView("d0", Role.DECODE, "d0", load, None)],
                [InstanceView("a0", Role.AGGREGATED, "a0", load, None)]]

    def place(self, policy, prompt_len: int) -> Placement:
        request = ScheduleRequest(request_id="r", model="m", prompt_len=prompt_len,
                                  prompt_token_ids=tuple(range(3, 3 + prompt_len)), sampling=SamplingParams(),
                                  deadline=0.0)
        placed = place_pair(policy, request, *self.views(), now=0.0)
        assert isinstance(placed, Placement), placed
        return placed

    def test_short_prompts_are_served_whole_and_long_ones_handed_off(self):
        policy = build_placement(self.SETTINGS).policy
        policy.adopt(SPEC, "p0")
        short, long = self.place(policy, 3), self.place(policy, 2000)
        assert (short.prefill, short.decode, short.whole) == ("a0", "a0", True)
        assert short.whole_cost_s == pytest.approx(0.003 * 5) and short.handoff_cost_s > short.whole_cost_s
        assert (long.prefill, long.decode, long.whole) == ("p0", "d0", False)
        assert long.whole_cost_s == pytest.approx(2.0 * 5) and long.handoff_cost_s < long.whole_cost_s

    def test_an_aggregated_instance_holding_a_prompt_counts_it_once_in_its_batch(self):
        # the ledger holds two entries (prefill, decode) of a request placed whole until its first token: the
        # batch its TBT is predicted for counts requests, so three prompts waiting there weigh as three decoding
        policy = build_placement(self.SETTINGS).policy
        policy.adopt(SPEC, "a0")
        aggregated = [InstanceView("a0", Role.AGGREGATED, "a0", Load(total_kv_blocks=1000, free_kv_blocks=1000), None)]
        both, decoding = WorkLedger(), WorkLedger()
        for i in range(3):
            placed = Placed(conductor="c0", prefill_instance="a0", decode_instance="a0", request_id=f"r{i}",
                            prefill_s=0.5, prompt_tokens=10)
            both.place(placed.request_id, placement_stages(placed, now=0.0), now=0.0)
            decoding.place(placed.request_id, placement_stages(placed, now=0.0)[1:], now=0.0)
        request = ScheduleRequest(request_id="r", model="m", prompt_len=10, prompt_token_ids=tuple(range(3, 13)),
                                  sampling=SamplingParams(), deadline=0.0)
        predicted = [place_pair(policy, request, [], [], [v._replace(outstanding=ledger.outstanding("a0"))
                                                          for v in aggregated], now=0.0).predicted_tbt_ms
                     for ledger in (both, decoding)]
        assert predicted[0] is not None and predicted[0] == predicted[1]

    def test_neither_option_within_the_slos_is_a_rejection_naming_both(self):
        # the prefill instance holds 100 s of work (TTFT SLO 60 s); serving whole, the batch of 4 would take
        # 12 ms + 512 ms steps with the prompt's last chunk in them (TBT SLO 0.3 s)
        policy = build_placement(PolicySettings(prefill_tokens_per_s=1000.0, ttft_slo_s=60.0, tbt_slo_s=0.3)).policy
        policy.adopt(SPEC, "p0")
        prefill, decode, aggregated = self.views()
        prefill = [prefill[0]._replace(outstanding=Outstanding(1, 100.0, 1000, 1))]
        request = ScheduleRequest(request_id="r", model="m", prompt_len=2000, prompt_token_ids=tuple(range(3, 2003)),
                                  sampling=SamplingParams(), deadline=0.0)
        refused = place_pair(policy, request, prefill, decode, aggregated, now=0.0)
        assert isinstance(refused, Rejection) and refused.reason is RejectReason.OVERLOADED, refused
        assert refused.message.startswith("no_option_within_slo") and "hand-off rejected" in refused.message
        assert "whole TTFT" in refused.message
        # the same request migrating (admitted once, tokens streamed) is placed: rejected, it would be lost
        migrated = place_pair(policy, msgspec.structs.replace(request, attempt=1), prefill, decode, aggregated, now=0.0)
        assert isinstance(migrated, Placement), migrated

    def test_before_the_kv_spec_the_least_loaded_choice_stands(self):
        placed = self.place(build_placement(self.SETTINGS).policy, 2000)
        assert placed.handoff_cost_s is None and placed.whole_cost_s is None

    def test_a_negative_overhead_is_refused(self):
        with pytest.raises(ValueError, match="handoff_overhead_s"):
            PolicySettings(handoff_overhead_s=-0.1).check_policy()

    def test_an_aggregated_placement_holds_its_prefill_work_only_until_the_first_token(self):
        placed = Placed(conductor="c0", prefill_instance="a0", decode_instance="a0", request_id="r", prefill_s=0.5,
                        max_tokens=64, ttl_s=5.0, decode_ttl_s=9.0)
        prefill, decode = placement_stages(placed, now=10.0)
        assert (prefill.instance_id, prefill.expires_at, prefill.work_s, prefill.decode_tokens) == ("a0", 15.0, 0.5, 0)
        assert (decode.instance_id, decode.expires_at, decode.work_s, decode.decode_tokens) == ("a0", 19.0, 0.0, 64)
        ledger = WorkLedger(grace_s=1.0)
        ledger.place("r", (prefill, decode), 10.0)
        ledger.done("r", "a0", Cleared.COMPLETED, 11.0)  # the aggregated instance's first token
        # what is left is the decode stage: its request, and the tokens its sequence will decode
        assert ledger.outstanding("a0") == Outstanding(1, 0.0, placed.prompt_tokens, 1, decode_tokens=64, decoders=1)
        ledger.done("r", "a0", Cleared.COMPLETED, 12.0)
        assert ledger.outstanding("a0") == Outstanding()


class TestPipelinePlacement:
    def test_every_stage_of_a_pipelined_prefill_is_in_the_ledger(self):
        placed = Placed(conductor="c0", prefill_instance="p0", decode_instance="d0", request_id="r", prefill_s=0.5,
                        ttl_s=5.0, decode_ttl_s=9.0, pipeline=("p1",))
        ledger = WorkLedger(grace_s=1.0)
        ledger.place("r", placement_stages(placed, now=10.0), 10.0)
        assert [(s.instance_id, s.order) for s in ledger.stages("r")] == [("p0", 0), ("p1", 0), ("d0", 1)]
        assert ledger.outstanding("p1") == Outstanding(1, 0.5, 0, 1)
        ledger.done("r", "p1", Cleared.COMPLETED, 11.0)  # the stage's WorkDone
        ledger.done("r", "p0", Cleared.COMPLETED, 11.0)
        assert [s.instance_id for s in ledger.stages("r")] == ["d0"]


class TestFirstTokenWatch:
    """The conductor learns each of its placements' delivered TTFT from the prefill instance's WorkDone."""

    @staticmethod
    def done(instance: str, outcome: WorkOutcome = WorkOutcome.COMPLETED, request: str = "r") -> WorkDone:
        return WorkDone(request_id=request, instance_id=instance, outcome=outcome)

    def test_the_prefill_instance_completing_gives_model_and_delivered(self):
        watch = FirstTokenWatch()
        watch.expect("r", "p0", model_ttft_s=0.4, now=10.0)
        assert watch.done(self.done("p0"), now=10.5) == (0.4, pytest.approx(0.5))
        assert watch.done(self.done("p0"), now=11.0) is None and len(watch) == 0  # once

    def test_other_instances_and_failures_give_nothing(self):
        watch = FirstTokenWatch()
        watch.expect("r", "p1", model_ttft_s=0.4, now=10.0)
        assert watch.done(self.done("p0"), now=10.5) is None and len(watch) == 1  # an earlier attempt's
        assert watch.done(self.done("p1", WorkOutcome.FAILED), now=10.6) is None and len(watch) == 0

    def test_a_new_attempt_replaces_the_old(self):
        watch = FirstTokenWatch()
        watch.expect("r", "p0", model_ttft_s=0.4, now=10.0)
        watch.expect("r", "p1", model_ttft_s=0.9, now=12.0)
        assert watch.done(self.done("p0"), now=12.1) is None
        assert watch.done(self.done("p1"), now=13.0) == (0.9, pytest.approx(1.0))

    def test_at_most_limit_are_held_and_the_oldest_go(self):
        watch = FirstTokenWatch(limit=2)
        for i in range(3):
            watch.expect(f"r{i}", "p0", model_ttft_s=0.1, now=float(i))
        assert len(watch) == 2 and watch.done(self.done("p0", request="r0"), now=5.0) is None
        assert watch.done(self.done("p0", request="r2"), now=5.0) is not None
