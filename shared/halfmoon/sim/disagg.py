"""Halfmoon's shape: a prefill pool and a decode pool, scheduled by the shared Conductor policies."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from halfmoon.policy.admission import make_admission
from halfmoon.policy.cpp import CppPolicy
from halfmoon.policy.decode import SloAwareDecode
from halfmoon.policy.ledger import Cleared, Stage, WorkLedger
from halfmoon.policy.prefill import make_prefill_policy
from halfmoon.policy.scheduler import KVCentricScheduler, ScheduleDecision
from halfmoon.policy.state import (
    DecodeInstanceState,
    DecodeWork,
    PrefillInstanceState,
    RecentSamples,
    RouteRequest,
)
from halfmoon.sim.batch import DecodeBatch
from halfmoon.sim.cache import ClusterCache
from halfmoon.sim.config import SimConfig
from halfmoon.sim.engine import ARRIVE, SimBase
from halfmoon.sim.profile import Profile
from halfmoon.sim.trace import TraceRequest

PREFILL_DONE, DECODE_JOIN, DECODE_EPOCH = 1, 2, 3


class _PrefillNode:
    __slots__ = ("busy_until", "id", "recent_ttft")

    def __init__(self, id_: str) -> None:
        self.id = id_
        self.busy_until = 0.0
        self.recent_ttft = RecentSamples()


class _DecodeNode:
    __slots__ = ("batch", "id", "incoming", "ready_at", "recent_tbt", "state", "version", "waiting")

    def __init__(self, id_: str, batch: DecodeBatch) -> None:
        self.id = id_
        self.batch = batch
        self.waiting: deque[int] = deque()
        self.incoming: dict[int, DecodeWork] = {}
        self.version = 0
        self.recent_tbt = RecentSamples()
        self.state: DecodeInstanceState | None = None
        self.ready_at: dict[int, float] = {}


class DisaggregatedSim(SimBase):
    def __init__(self, config: SimConfig, profile: Profile, trace: Sequence[TraceRequest]) -> None:
        super().__init__(config, profile, trace)
        self.prefill = [_PrefillNode(f"p{i}") for i in range(config.prefill_nodes)]
        self.decode = [_DecodeNode(f"d{i}", DecodeBatch(self.cost.decode)) for i in range(config.decode_nodes)]
        self._prefill_by_id = {n.id: n for n in self.prefill}
        self._decode_idx = {n.id: i for i, n in enumerate(self.decode)}
        self.cache: ClusterCache = ClusterCache([n.id for n in self.prefill], config.per_node_blocks(config.prefill_nodes), config.eviction)
        prefill_kwargs: dict[str, float] = {"seed": config.seed} if config.prefill_policy == "random" else {}
        if config.prefill_policy == "global-cache-aware":
            prefill_kwargs = {"balancing_threshold": config.balancing_threshold}
        self.decode_policy = SloAwareDecode(self.cost.decode, config.slo)
        self.scheduler = KVCentricScheduler(
            make_prefill_policy(config.prefill_policy, self.cost, config.slo, **prefill_kwargs),
            make_admission(config.admission, self.decode_policy),
            config.slo,
            None if (cpp := config.cpp_settings()) is None else CppPolicy(self.cost, cpp),
        )
        self.ledger = WorkLedger()  # the conductor's: prefill work placed and not done, per node
        self._jobs: dict[int, tuple[tuple[_PrefillNode, ...], int, tuple, int | None, float]] = {}

    def _dispatch(self, kind: int, a: int, b: int) -> None:
        if kind == ARRIVE:
            self._arrive(a)
        elif kind == PREFILL_DONE:
            self._prefill_done(a)
        elif kind == DECODE_JOIN:
            self._decode_join(self.decode[b], a)
        elif self.decode[a].version == b:
            self._epoch_end(self.decode[a])

    # -- conductor ---------------------------------------------------------------------------
    def _decode_state(self, node: _DecodeNode) -> DecodeInstanceState:
        if node.state is None:
            batch, horizon = node.batch, self.expected_decode_s
            work = [DecodeWork(m.context, m.joined_at, m.joined_at + horizon) for m in batch.members.values()]
            waiting_ctx = 0
            for rid in node.waiting:
                ctx = self.trace[rid].input_length
                waiting_ctx += ctx
                work.append(DecodeWork(ctx, self.now, self.now + horizon))
            work.extend(node.incoming.values())
            node.state = DecodeInstanceState(
                node.id, len(batch.members) + len(node.waiting), batch.context + waiting_ctx,
                self.profile.decode_capacity_tokens, node.recent_tbt.values(self.now), tuple(work),
            )
        return node.state

    def _route(self, rid: int) -> RouteRequest:
        req = self.trace[rid]
        return RouteRequest(req.hash_ids, req.input_length, self.cfg.block_size, req.output_length,
                            waited_s=self.waited_s(rid))

    def _schedule(self, sched_req: RouteRequest) -> ScheduleDecision:
        """The Conductor's decision for a hand-off over the prefill and decode pools."""
        now = self.now
        pstates = [
            PrefillInstanceState(n.id, max(0.0, n.busy_until - now), self.ledger.outstanding(n.id).tokens,
                                 n.recent_ttft.values(now))
            for n in self.prefill
        ]
        dstates = [self._decode_state(n) for n in self.decode]
        return self.scheduler.schedule(sched_req, pstates, dstates, self.cache.index, now)

    def _arrive(self, rid: int) -> None:
        sched_req = self._route(rid)
        decision = self._schedule(sched_req)
        if not decision.accepted:
            self.turn_away(rid, decision.clears_in_s)
            return
        self._hand_off(rid, sched_req, decision)

    def _hand_off(self, rid: int, sched_req: RouteRequest, decision: ScheduleDecision) -> None:
        """Prefill on the decision's prefill node (or pipeline), decode where it planned or at hand-off."""
        req, now = self.trace[rid], self.now
        choice = decision.prefill
        assert choice is not None, "an accepted decision carries its prefill choice"
        node = self._prefill_by_id[choice.instance_id]
        local = choice.prefix_blocks - len(choice.pulls)
        # a pipeline holds all its stages from when the busiest one is free until the last chunk leaves
        ids = (node.id,) if decision.pipeline is None else decision.pipeline.stages
        stages = tuple(self._prefill_by_id[i] for i in ids)
        done = max(now, *(n.busy_until for n in stages)) + choice.transfer_s + choice.prefill_s
        for stage in stages:
            stage.busy_until = done
        self.ledger.place(rid, [Stage(n.id, 0, math.inf, choice.transfer_s + choice.prefill_s, req.input_length)
                                for n in stages], now)
        self.pipelined += decision.pipeline is not None
        self.cache.node(node.id).lock(req.hash_ids[:local])
        for key, src in choice.pulls:
            self.cache.node(src).lock((key,))
        self.pulled_blocks += len(choice.pulls)
        self.out.hit_blocks[rid] = choice.prefix_blocks
        # compute per request: a pipeline spends the single-node FLOPs, spread over its stages
        if decision.pipeline is None:
            self.out.prefill_s[rid] = choice.prefill_s
        else:
            cached = sched_req.cached_tokens(choice.prefix_blocks)
            self.out.prefill_s[rid] = self.cost.prefill.predict(req.input_length - cached, cached)
        planned = None
        if decision.decode is not None:
            planned = self._decode_idx[decision.decode.instance_id]
            target = self.decode[planned]
            target.incoming[rid] = DecodeWork(req.input_length, done, done + self.expected_decode_s)
            target.state = None
        self._jobs[rid] = (stages, local, choice.pulls, planned, done)
        self.push(done, PREFILL_DONE, rid)

    def _prefill_done(self, rid: int) -> None:
        stages, local, pulls, planned, _ = self._jobs.pop(rid)
        node = stages[0]
        req, now = self.trace[rid], self.now
        keys = req.hash_ids
        self.ledger.end(rid, now, Cleared.COMPLETED)
        self.cache.node(node.id).unlock(keys[:local])
        for key, src in pulls:
            self.cache.node(src).unlock((key,))
        self.cache.node(node.id).insert(keys[: req.input_length // self.cfg.block_size], now)
        node.recent_ttft.add(now, now - self.out.arrival[rid])
        if planned is not None:
            self.decode[planned].incoming.pop(rid, None)
            self.decode[planned].state = None
        if not self.first_token(rid, now):
            return
        target = self._handoff_target(req.input_length, planned)
        if target is None:
            self.reject(rid, late=True)
            return
        self.decode[target].ready_at[rid] = now
        self.push(now + self.profile.handoff_seconds(req.input_length), DECODE_JOIN, rid, target)

    def _handoff_target(self, context: int, planned: int | None) -> int | None:
        if planned is not None and self.decode_policy.choose([self._decode_state(self.decode[planned])], context):
            return planned
        choice = self.decode_policy.choose([self._decode_state(n) for n in self.decode], context)
        return None if choice is None else self._decode_idx[choice.instance_id]

    # -- decode nodes ------------------------------------------------------------------------
    def _decode_join(self, node: _DecodeNode, rid: int) -> None:
        node.state = None
        batch = node.batch
        if batch.kmax and batch.t0 <= self.now:
            k, _ = batch.boundary_after(self.now)
            self._finish(node, batch.close(k))
        elif not batch.kmax:
            batch.t0 = max(batch.t0, self.now)
        node.waiting.append(rid)
        self._admit_waiting(node)
        self._restart(node)

    def _epoch_end(self, node: _DecodeNode) -> None:
        node.state = None
        self._finish(node, node.batch.close(node.batch.kmax))
        self._admit_waiting(node)
        self._restart(node)

    def _finish(self, node: _DecodeNode, members) -> None:
        for tbt in self.decoded(node.batch, members):
            node.recent_tbt.add(node.batch.t0, tbt)

    def _admit_waiting(self, node: _DecodeNode) -> None:
        batch, cap = node.batch, self.profile.decode_capacity_tokens
        while node.waiting:
            req = self.trace[node.waiting[0]]
            if batch.members and batch.context + req.input_length > cap:
                return
            rid = node.waiting.popleft()
            batch.add(rid, req.input_length, req.output_length - 1, node.ready_at.pop(rid))

    def _restart(self, node: _DecodeNode) -> None:
        node.version += 1
        end = node.batch.begin(node.batch.t0)
        if end is not None:
            self.push(end, DECODE_EPOCH, self._decode_idx[node.id], node.version)
