"""The conductor's ledger of placed work drains however a request ends."""

from __future__ import annotations

import random

import pytest

from halfmoon.policy.ledger import Cleared, Outstanding, Stage, WorkLedger


def placement(prefill: str = "p0", decode: str = "d0", work_s: float = 2.0, tokens: int = 100,
              expires_at: float = 100.0) -> list[Stage]:
    return [Stage(prefill, 0, expires_at, work_s, tokens), Stage(decode, 1, expires_at + 50, 0.0, tokens)]


def ledger_with(*rids: str, grace_s: float = 1.0, now: float = 0.0) -> WorkLedger:
    ledger = WorkLedger(grace_s)
    for rid in rids:
        ledger.place(rid, placement(), now)
    return ledger


class TestPlacing:
    def test_each_instance_holds_its_stage(self):
        ledger = ledger_with("a", "b")
        assert ledger.outstanding("p0") == Outstanding(2, 4.0, 200, 2)
        assert ledger.outstanding("d0") == Outstanding(2, 0.0, 200, 2)
        assert ledger.outstanding("elsewhere") == Outstanding()
        assert len(ledger) == 4

    def test_placing_a_request_again_replaces_the_earlier_attempt(self):
        ledger = ledger_with("a")
        ledger.place("a", placement("p1", "d1"), now=1.0)
        assert ledger.outstanding("p0") == Outstanding() and ledger.outstanding("p1").count == 1
        assert ledger.cleared[Cleared.REPLACED] == 2

    def test_paced_prompt_work_is_counted_apart_and_leaves_with_its_stage(self):
        ledger = ledger_with("a")
        ledger.place("paced", [Stage("p0", 0, 100.0, 9.0, 2_725, paced=True), Stage("p0", 1, 150.0, 0.0, 2_725, 32)],
                     now=0.0)
        assert ledger.outstanding("p0") == Outstanding(3, 11.0, 100 + 2 * 2_725, 2, 32, 1, paced_work_s=9.0)
        ledger.done("paced", "p0", Cleared.COMPLETED, now=1.0)  # its first token: the prefill stage is done
        assert ledger.outstanding("p0").paced_work_s == 0.0 and ledger.outstanding("p0").work_s == 2.0

    def test_a_placement_needs_a_stage(self):
        with pytest.raises(ValueError):
            WorkLedger().place("a", [], now=0.0)
        with pytest.raises(ValueError):
            WorkLedger(grace_s=-1)


class TestEndings:
    def test_completed_prefill_leaves_decode_then_completed_decode_leaves_nothing(self):
        ledger = ledger_with("a")
        assert ledger.done("a", "p0", Cleared.COMPLETED, now=1.0) == 1
        assert ledger.outstanding("p0") == Outstanding() and ledger.outstanding("d0").count == 1
        assert ledger.done("a", "d0", Cleared.COMPLETED, now=2.0) == 1
        assert len(ledger) == 0 and ledger.cleared[Cleared.COMPLETED] == 2

    @pytest.mark.parametrize("how", [Cleared.FAILED, Cleared.CANCELLED])
    @pytest.mark.parametrize("where", ["p0", "d0"])
    def test_a_failure_or_cancellation_anywhere_ends_the_whole_request(self, where, how):
        ledger = ledger_with("a", "b")
        assert ledger.done("a", where, how, now=1.0) == 2
        assert ledger.stages("a") == () and ledger.outstanding("p0").count == 1
        assert ledger.cleared[how] == 2

    def test_news_from_an_instance_outside_the_placement_is_about_an_older_attempt(self):
        ledger = ledger_with("a")
        assert ledger.done("a", "p9", Cleared.FAILED, now=1.0) == 0
        assert ledger.done("unknown", "p0", Cleared.COMPLETED, now=1.0) == 0
        assert len(ledger) == 2

    def test_a_cancelled_request_leaves_every_instance(self):
        ledger = ledger_with("a", "b")
        assert ledger.end("a", now=1.0) == 2
        assert ledger.outstanding("p0").count == ledger.outstanding("d0").count == 1
        assert ledger.end("a", now=1.0) == 0
        assert ledger.cleared[Cleared.CANCELLED] == 2

    def test_an_instance_going_down_drops_its_entries_and_later_stages_become_due(self):
        ledger = ledger_with("a", "b", grace_s=1.0)
        assert ledger.instance_down("p0", now=5.0) == 2
        assert ledger.outstanding("p0") == Outstanding()
        # decode is now due: a heartbeat holding nothing drops it once the grace has passed
        assert ledger.reconcile("d0", held=0, now=5.5) == 0
        assert ledger.reconcile("d0", held=0, now=6.0) == 2
        assert len(ledger) == 0


class TestExpiry:
    def test_entries_without_news_expire_at_their_deadline(self):
        ledger = WorkLedger()
        ledger.place("a", placement(expires_at=10.0), now=0.0)
        ledger.place("b", placement(expires_at=20.0), now=0.0)
        assert ledger.expire(now=9.9) == 0
        assert ledger.expire(now=10.0) == 1  # a's prefill; its decode lives on till 60
        assert ledger.outstanding("p0").count == 1 and ledger.outstanding("d0").count == 2
        assert ledger.expire(now=100.0) == 3
        assert len(ledger) == 0 and ledger.cleared[Cleared.EXPIRED] == 4


class TestReconcile:
    def test_placements_never_taken_are_dropped_oldest_first_after_the_grace(self):
        ledger = WorkLedger(grace_s=1.0)
        for i, rid in enumerate(("old", "mid", "new")):
            ledger.place(rid, placement(work_s=float(i + 1)), now=float(i))
        # at 2.5 only "old" and "mid" are past the grace; the instance holds one: "old" goes
        assert ledger.reconcile("p0", held=1, now=2.5) == 1
        assert [s.instance_id for s in ledger.stages("old")] == ["d0"]  # decode is due now
        assert ledger.outstanding("p0") == Outstanding(2, 5.0, 200, 2)

    def test_an_idle_instance_clears_everything_due_long_enough(self):
        ledger = ledger_with(*(f"r{i}" for i in range(40)))
        assert ledger.outstanding("p0").work_s == 80.0
        assert ledger.reconcile("p0", held=0, now=1.0) == 40
        assert ledger.outstanding("p0") == Outstanding()
        assert ledger.reconcile("d0", held=0, now=1.5) == 0  # decode became due at 1.0
        assert ledger.reconcile("d0", held=0, now=2.0) == 40
        assert len(ledger) == 0 and ledger.cleared[Cleared.RECONCILED] == 80

    def test_decode_waiting_for_its_prefill_is_not_reconciled(self):
        ledger = ledger_with("a")
        assert ledger.reconcile("d0", held=0, now=50.0) == 0
        assert ledger.outstanding("d0").count == 1

    def test_an_instance_holding_as_many_as_placed_keeps_them(self):
        ledger = ledger_with("a", "b")
        assert ledger.reconcile("p0", held=5, now=10.0) == 0
        assert ledger.outstanding("p0").count == 2


class TestSameInstanceBothStages:
    def test_one_instance_serving_both_stages_reports_each_part(self):
        ledger = WorkLedger()
        ledger.place("a", placement("x", "x"), now=0.0)
        assert (ledger.outstanding("x").count, ledger.outstanding("x").requests) == (2, 1)  # one request here
        assert ledger.done("a", "x", Cleared.COMPLETED, now=1.0) == 1  # prefill over: its work leaves
        assert [s.order for s in ledger.stages("a")] == [1]
        assert (ledger.outstanding("x").count, ledger.outstanding("x").requests) == (1, 1)
        assert ledger.done("a", "x", Cleared.COMPLETED, now=2.0) == 1
        assert len(ledger) == 0

    def test_decoders_are_the_decode_stages_with_a_gap_between_tokens(self):
        ledger = WorkLedger()
        ledger.place("long", [Stage("x", 0, 100.0, 1.0, 100), Stage("x", 1, 150.0, 0.0, 100, 32)], now=0.0)
        ledger.place("one", [Stage("x", 0, 100.0, 1.0, 100), Stage("x", 1, 150.0, 0.0, 100, 1)], now=0.0)
        held = ledger.outstanding("x")
        assert (held.decoders, held.decode_tokens, held.mean_decode_tokens) == (1, 32, 32.0)
        ledger.end("long", now=1.0)
        assert ledger.outstanding("x").decoders == 0 and ledger.outstanding("x").mean_decode_tokens == 0.0
        ledger.end("one", now=1.0)
        assert ledger.outstanding("x") == Outstanding()

    def test_a_failure_there_ends_both_parts(self):
        ledger = WorkLedger()
        ledger.place("a", placement("x", "x"), now=0.0)
        assert ledger.done("a", "x", Cleared.FAILED, now=1.0) == 2


class TestTotalsStayExact:
    def test_totals_equal_the_entries_after_any_mix_of_endings(self):
        rng = random.Random(3)
        ledger, rids, instances = WorkLedger(grace_s=0.5), [f"r{i}" for i in range(30)], ["p0", "p1", "d0", "d1"]
        for step in range(2000):
            now, rid, iid = step * 0.01, rng.choice(rids), rng.choice(instances)
            op = rng.randrange(6)
            if op == 0:
                ledger.place(rid, placement(rng.choice(instances[:2]), rng.choice(instances), rng.random(),
                                            rng.randrange(1, 50), now + rng.random() * 5), now)
            elif op == 1:
                ledger.done(rid, iid, rng.choice(list(Cleared)), now)
            elif op == 2:
                ledger.end(rid, now)
            elif op == 3:
                ledger.reconcile(iid, rng.randrange(3), now)
            elif op == 4:
                ledger.expire(now)
            else:
                ledger.instance_down(iid, now)
            for inst in instances:
                stages = [s for r in rids for s in ledger.stages(r) if s.instance_id == inst]
                held = ledger.outstanding(inst)
                assert (held.count, held.tokens) == (len(stages), sum(s.tokens for s in stages))
                assert held.requests == sum(any(s.instance_id == inst for s in ledger.stages(r)) for r in rids)
                assert held.work_s == pytest.approx(sum(s.work_s for s in stages))
        assert len(ledger) == sum(len(ledger.stages(r)) for r in rids)
