"""The pace of an instance's decoding steps lately: the rule the live heartbeat and the simulator share."""

from __future__ import annotations

import pytest

from halfmoon.policy.step_window import WINDOW_S, DecodingSteps, pace_changes_after, step_pace


def one_by_one(run: DecodingSteps) -> list[DecodingSteps]:
    """The steps of ``run`` as an engine reports them, each ending ``seconds`` after the one before."""
    first = run.ended - run.seconds * (run.steps - 1)
    return [run._replace(ended=first + i * run.seconds, steps=1) for i in range(run.steps)]


class TestRunsOfSteps:
    # a wave decoding alone, a prompt chunk sharing the steps of three of them, then eight decoding alone
    RUNS = (DecodingSteps(ended=101.0, seconds=0.1, decoding=4, kv_tokens=800.0, shared=False, steps=10),
            DecodingSteps(ended=103.4, seconds=1.2, decoding=3, kv_tokens=2400.0, shared=True, steps=2),
            DecodingSteps(ended=104.6, seconds=0.15, decoding=8, kv_tokens=4000.0, shared=False, steps=8))

    def test_a_run_of_steps_is_its_steps_one_by_one(self):
        """The simulator closes steps by the run (every step of a run alike); an engine reports them one by one."""
        steps = [step for run in self.RUNS for step in one_by_one(run)]
        runs, singles = step_pace(self.RUNS, now=105.0), step_pace(steps, now=105.0)
        assert runs is not None and singles is not None
        assert runs == pytest.approx(singles)
        gaps = 10 * 4 + 2 * 3 + 8 * 8
        # the level: the (lower) median of the gaps of steps alone, 64 of them at 0.15 s and 40 at 0.1 s
        assert runs.steps == 20 and runs.prompt_s == pytest.approx(2 * 3 * (1.2 - 0.15) / gaps)
        assert runs.seconds == pytest.approx(0.15 + runs.prompt_s)

    def test_the_pace_holds_until_the_oldest_steps_leave_the_window(self):
        now = 105.0
        until = pace_changes_after(self.RUNS, now)
        assert until == pytest.approx(self.RUNS[0].ended + WINDOW_S)
        assert step_pace(self.RUNS, until) == step_pace(self.RUNS, now)
        # past it the wave decoding alone is no longer in the window, and the window does not need it: the
        # steps after it hold a decode-only step, though fewer gaps than the window reaches back for, and so it
        # reaches back for them
        later = step_pace(self.RUNS, until + 1e-6)
        assert later == step_pace(self.RUNS, now)
        # a window's length of idleness later, nothing
        assert step_pace(self.RUNS, self.RUNS[-1].ended + WINDOW_S + 1e-6) is None
        assert pace_changes_after([], now) == float("inf")
