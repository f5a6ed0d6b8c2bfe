"""Event heap, outcome bookkeeping and decode-completion handling shared by both cluster shapes."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from halfmoon.policy.admission import overload_pause
from halfmoon.sim.batch import DecodeBatch, Member
from halfmoon.sim.cache import ClusterCache
from halfmoon.sim.config import SimConfig
from halfmoon.sim.metrics import OK, REJECTED_EARLY, REJECTED_LATE, Outcomes, Summary, slowest_decile_mean, summarize
from halfmoon.sim.profile import Profile
from halfmoon.sim.trace import TraceRequest

Progress = Callable[[int, int], None]
ARRIVE = 0  # every cluster shape's event kind 0: a request asks to be placed (again, after an overload)
REPLICA_RANKS = (10, 100, 1000, 10000)


class ReplicaStat(NamedTuple):
    rank: int
    mean_replicas: float
    peak_replicas: int


class SimResult(NamedTuple):
    config: SimConfig
    outcomes: Outcomes
    summary: Summary
    replicas: tuple[ReplicaStat, ...]
    pulled_blocks: int
    wasted_prefill_s: float
    sim_seconds: float
    wall_seconds: float
    events: int
    pipelined: int = 0  # requests prefilled by a CPP pipeline
    whole: np.ndarray | None = None  # mixed layout: per request, True where an aggregated node served it whole


class SimBase:
    """Owns the clock and the event heap; subclasses implement ``_dispatch`` and ``_arrive``."""

    def __init__(self, config: SimConfig, profile: Profile, trace: Sequence[TraceRequest]) -> None:
        self.cfg = config
        self.profile = profile
        self.cost = profile.cost
        self.trace = trace
        self.out = Outcomes(len(trace))
        self.now = 0.0
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = itertools.count()
        self.events = 0
        self.pulled_blocks = 0
        self.wasted_prefill_s = 0.0
        self.pipelined = 0
        self.expected_decode_s = config.expected_decode_s
        self.cache: ClusterCache | None = None
        self._settled = 0

    def push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, a, b))

    def run(self, progress: Progress | None = None) -> SimResult:
        started = time.perf_counter()
        scale = self.cfg.time_scale
        for i, req in enumerate(self.trace):
            self.out.arrival[i] = req.arrival_s / scale
            self.out.blocks[i] = len(req.hash_ids)
            self.push(req.arrival_s / scale, ARRIVE, i)
        total = len(self.trace)
        every = max(1, total // 200)
        heap = self._heap
        while heap:
            t, _, kind, a, b = heapq.heappop(heap)
            self.now = t
            self.events += 1
            self._dispatch(kind, a, b)
            if progress is not None and self.events % every == 0:
                progress(self._settled, total)
        if progress is not None:
            progress(self._settled, total)
        return self._result(time.perf_counter() - started)

    def _dispatch(self, kind: int, a: int, b: int) -> None:
        raise NotImplementedError

    def waited_s(self, rid: int) -> float:
        """How long request ``rid`` has waited for a placement (it asks again after an overload)."""
        return self.now - float(self.out.arrival[rid])

    def turn_away(self, rid: int, clears_in_s: float | None) -> None:
        """An early rejection: asked again later where the gateway would wait it out, else rejected."""
        waited = self.waited_s(rid)
        pause = overload_pause(clears_in_s, waited, self.cfg.overload_wait_s)
        if pause is None:
            self.reject(rid, late=False)
            return
        self.out.waited[rid] = waited + pause
        self.push(self.now + pause, ARRIVE, rid)

    def reject(self, rid: int, late: bool) -> None:
        self.out.status[rid] = REJECTED_LATE if late else REJECTED_EARLY
        if late:
            self.wasted_prefill_s += float(self.out.prefill_s[rid])
        self._settled += 1

    def first_token(self, rid: int, t: float) -> bool:
        """Record TTFT; returns True when the request still has tokens to decode."""
        self.out.ttft[rid] = t - self.out.arrival[rid]
        if self.trace[rid].output_length <= 1:
            self.out.tbt[rid] = 0.0
            self.out.finished[rid] = t
            self._settled += 1
            return False
        return True

    def decoded(self, batch: DecodeBatch, members: list[Member]) -> list[float]:
        """Record finished members at the batch's current boundary; returns their TBTs."""
        tbts = []
        for m in members:
            values, counts = batch.intervals(m)
            tbt = slowest_decile_mean(values, counts, m.gap)
            self.out.tbt[m.rid] = tbt
            self.out.finished[m.rid] = batch.t0
            self.out.status[m.rid] = OK
            # NOTE: system-level prediction (paper): one moving average of decode durations
            self.expected_decode_s += 0.05 * ((batch.t0 - m.joined_at) - self.expected_decode_s)
            tbts.append(tbt)
            self._settled += 1
        return tbts

    def _result(self, wall: float) -> SimResult:
        ranking = self.cache.replica_ranking(self.now) if self.cache is not None else []
        replicas = tuple(
            ReplicaStat(r, ranking[r - 1][1], ranking[r - 1][2]) for r in REPLICA_RANKS if len(ranking) >= r
        )
        return SimResult(
            config=self.cfg,
            outcomes=self.out,
            summary=summarize(self.out, self.cfg.slo.ttft_s),
            replicas=replicas,
            pulled_blocks=self.pulled_blocks,
            wasted_prefill_s=self.wasted_prefill_s,
            sim_seconds=self.now,
            wall_seconds=wall,
            events=self.events,
            pipelined=self.pipelined,
        )
