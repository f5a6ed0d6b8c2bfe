"""Continuous batching on one node, advanced per membership change rather than per token.

Between two changes (a request joins, finishes, or a prefill chunk starts) the batch is
fixed, so step ``j`` of the epoch takes ``tau0 + inc * j``: the decode step grows by
``b`` context tokens per step, and a chunked prefill riding along grows with the prefix it
attends to. Epoch durations are closed-form sums; each closed epoch is logged once as
(mean interval, steps), and a request's token intervals are exactly the epochs it lived
through, which is all the TBT metric needs. The closed epochs that advanced decoding sequences are also kept
as the steps an engine would have reported (``pace``), which the node's TBT predictions start from, as a live
instance's do.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from halfmoon.policy.cost import DecodeCostModel
from halfmoon.policy.step_window import DecodingSteps, StepPace, forget_unreachable, pace_changes_after, step_pace


class Member:
    __slots__ = ("context", "finish_step", "gap", "join_step", "joined_at", "log_start", "rid")

    def __init__(self, rid: int, context: int, join_step: int, tokens: int, log_start: int, gap: float, joined_at: float):
        self.rid = rid
        self.context = context
        self.join_step = join_step
        self.finish_step = join_step + tokens
        self.log_start = log_start
        self.gap = gap
        self.joined_at = joined_at


class DecodeBatch:
    def __init__(self, cost: DecodeCostModel) -> None:
        self.cost = cost
        self.members: dict[int, Member] = {}
        self._finish: list[tuple[int, int]] = []
        self.step = 0
        self.context = 0
        self.t0 = 0.0
        self.tau0 = 0.0
        self.inc = 0.0
        self.kmax = 0
        self.shared = False
        self.means: list[float] = []
        self.counts: list[int] = []
        self.steps: deque[DecodingSteps] = deque(maxlen=4096)
        self._pace: tuple[int, float, StepPace | None] = (-1, -1.0, None)  # (steps closed, valid until, pace)

    def elapsed(self, k: int) -> float:
        return k * self.tau0 + self.inc * k * (k - 1) / 2

    def begin(self, t: float, extra0: float = 0.0, extra_inc: float = 0.0, max_steps: int | None = None) -> float | None:
        """Start an epoch at ``t`` (the batch plus an optional per-step extra, e.g. a prefill
        chunk). It lasts until the next member finishes or ``max_steps``; returns its end time,
        or None when there is nothing to run."""
        self.t0 = t
        b = len(self.members)
        k = self._finish[0][0] - self.step if b else None
        if max_steps is not None:
            k = max_steps if k is None else min(k, max_steps)
        if not k:
            self.kmax = 0
            return None
        self.kmax = k
        self.shared = extra0 > 0
        self.tau0 = self.cost.predict(b, self.context) + extra0
        self.inc = self.cost.per_context_token * b + extra_inc
        return t + self.elapsed(k)

    def pace(self, now: float) -> StepPace | None:
        """The pace of the steps closed lately (``policy.step_window.step_pace``), computed again only once it
        can have changed: a simulation asks for it at every arrival, on every node."""
        closed, until, pace = self._pace
        if closed == self.step and now <= until:
            return pace
        forget_unreachable(self.steps, now)
        history = tuple(self.steps)
        pace = step_pace(history, now)
        self._pace = (self.step, pace_changes_after(history, now), pace)
        return pace

    def boundary_after(self, t: float) -> tuple[int, float]:
        """(steps done, time) of the first step boundary at or after ``t`` in the running epoch."""
        if not self.kmax or t <= self.t0:
            return 0, self.t0
        dt = t - self.t0
        if self.inc > 0:
            half = self.inc / 2
            k = int((-(self.tau0 - half) + math.sqrt((self.tau0 - half) ** 2 + 4 * half * dt)) / (2 * half))
        else:
            k = int(dt / self.tau0) if self.tau0 > 0 else self.kmax
        k = min(max(k, 0), self.kmax)
        while k > 0 and self.elapsed(k) > dt:
            k -= 1
        while k < self.kmax and self.elapsed(k + 1) <= dt:
            k += 1
        if k < self.kmax and self.elapsed(k) < dt:
            k += 1
        return k, self.t0 + self.elapsed(k)

    def close(self, k: int) -> list[Member]:
        """End the running epoch after ``k`` steps; returns the members that finished."""
        if k > 0:
            mean, b = self.tau0 + self.inc * (k - 1) / 2, len(self.members)
            self.means.append(mean)
            self.counts.append(k)
            self.t0 += self.elapsed(k)
            if b:
                self.steps.append(DecodingSteps(self.t0, mean, b, self.context + b * (k - 1) / 2, self.shared, k))
            self.step += k
            self.context += b * k
        self.kmax = 0
        done = []
        while self._finish and self._finish[0][0] <= self.step:
            _, rid = heapq.heappop(self._finish)
            member = self.members.pop(rid)
            self.context -= member.context + (self.step - member.join_step)
            done.append(member)
        return done

    def add(self, rid: int, context: int, tokens: int, ready_at: float) -> None:
        """Join at the current boundary ``t0``; ``ready_at`` is when its previous token was emitted."""
        member = Member(rid, context, self.step, tokens, len(self.means), max(0.0, self.t0 - ready_at), self.t0)
        self.members[rid] = member
        self.context += context
        heapq.heappush(self._finish, (member.finish_step, rid))

    def intervals(self, member: Member) -> tuple[list[float], list[int]]:
        return self.means[member.log_start:], self.counts[member.log_start:]
