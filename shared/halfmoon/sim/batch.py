"""Continuous batching on one node, advanced per membership change rather than per token.

Between two changes (a request joins, finishes, or a prefill chunk starts) the batch is
fixed, so step ``j`` of the epoch takes ``tau0 + inc * j``: the decode step grows by
``b`` context tokens per step, and a chunked prefill riding along grows with the prefix it
attends to. Epoch durations are closed-form sums; each closed epoch is logged once as
(mean interval, steps), and a request's token intervals are exactly the epochs it lived
through, which is all the TBT metric needs.
"""

from __future__ import annotations

import heapq
import math

from halfmoon.policy.cost import DecodeCostModel


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
        self.means: list[float] = []
        self.counts: list[int] = []

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
        self.tau0 = self.cost.predict(b, self.context) + extra0
        self.inc = self.cost.per_context_token * b + extra_inc
        return t + self.elapsed(k)

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
            self.means.append(self.tau0 + self.inc * (k - 1) / 2)
            self.counts.append(k)
            self.t0 += self.elapsed(k)
            self.step += k
            self.context += len(self.members) * k
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
