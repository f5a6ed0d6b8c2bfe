"""The coupled baseline: every node prefills and decodes in one continuous batch (vLLM-like).

Variants: ``plain`` (a waiting prompt batch runs as one prefill iteration that stalls the
decodes, as vLLM does without chunking), ``prefix`` (the same plus a prefix cache in the
node's HBM KV pool), ``chunked`` (each iteration decodes every running request and prefills
at most ``chunk_tokens`` of the oldest waiting prompt).

With an ``admission`` policy the nodes are Halfmoon's aggregated instances with no prefill/decode pair beside
them: the Conductor's scheduler places each request on one, which decodes it too, or turns it away.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from halfmoon.policy.admission import make_admission
from halfmoon.policy.cost import OnlineFitter, PrefillCostModel
from halfmoon.policy.decode import SloAwareDecode
from halfmoon.policy.ledger import is_decoder
from halfmoon.policy.prefill import make_prefill_policy
from halfmoon.policy.scheduler import KVCentricScheduler
from halfmoon.policy.state import (
    BlockIndex,
    DecodeInstanceState,
    MeasuredStep,
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

EPOCH = 1
IDLE, DECODING, PREFILLING = 0, 1, 2


class _Node:
    __slots__ = ("batch", "chunk", "extra", "id", "idx", "job", "kind", "pending_s", "recent_ttft", "version", "waiting", "waiting_tokens")

    def __init__(self, idx: int, batch: DecodeBatch) -> None:
        self.id = f"n{idx}"
        self.idx = idx
        self.batch = batch
        self.waiting: deque[int] = deque()
        self.pending_s = 0.0
        self.waiting_tokens = 0
        self.job: list[tuple[int, int]] = []  # (rid, cached tokens) prefilled in this iteration
        self.chunk: list[int] | None = None  # [rid, tokens done, cached tokens] being chunk-prefilled
        self.kind = IDLE
        self.version = 0
        self.recent_ttft = RecentSamples()
        self.extra = (0.0, 0.0, 0)  # prefill share of the running epoch: (first step, growth per step, chunk)


class CoupledSim(SimBase):
    def __init__(self, config: SimConfig, profile: Profile, trace: Sequence[TraceRequest]) -> None:
        super().__init__(config, profile, trace)
        self.nodes = [_Node(i, DecodeBatch(self.cost.decode)) for i in range(config.total_nodes)]
        self.chunked = config.coupled_variant == "chunked"
        if config.coupled_variant == "prefix":
            self.cache = ClusterCache(
                [n.id for n in self.nodes], profile.hbm_cache_tokens_per_node // config.block_size, config.eviction
            )
        kwargs = {"seed": config.seed} if config.coupled_router == "random" else {}
        # Halfmoon's aggregated instances (an admission policy) price prompts as a live conductor does: by a
        # model learned from each prompt's share of the steps it ran in, which also decoded the node's batch
        self.prefill_fitter = (None if config.admission == "none"
                               else OnlineFitter(PrefillCostModel.fit, self.cost.prefill))
        policy_cost = self.cost if self.prefill_fitter is None else self.cost._replace(
            prefill=self.prefill_fitter)  # type: ignore[arg-type]  # duck-typed: predict(new, cached)
        self.router = make_prefill_policy(config.coupled_router, policy_cost, config.slo, **kwargs)
        self.scheduler = None if config.admission == "none" else KVCentricScheduler(
            self.router, make_admission(config.admission, SloAwareDecode(self.cost.decode, config.slo)), config.slo)
        self._predicted: dict[int, float] = {}
        self._computed: dict[int, float] = {}  # a prompt's share of the steps it ran in so far, by tokens
        self._step_target: dict[int, float] = {}  # prompts admitted paced: the step their chunks keep within
        self._empty_index: dict = {}

    def _dispatch(self, kind: int, a: int, b: int) -> None:
        if kind == ARRIVE:
            self._arrive(a)
        elif self.nodes[a].version == b:
            self._epoch_end(self.nodes[a])

    def prefill_states(self) -> list[PrefillInstanceState]:
        # queued tokens include the running batch's context: the tie-breaker that spreads decode load
        return [
            PrefillInstanceState(n.id, n.pending_s, n.batch.context + n.waiting_tokens, n.recent_ttft.values(self.now))
            for n in self.nodes
        ]

    def decode_states(self) -> list[DecodeInstanceState]:
        """Each node as a decode instance that interleaves prefill, as the live conductor sees an aggregated
        instance: its batch, the prompts queued on it, the pace of its steps lately and the tokens its
        decoders spread prompt work over."""
        return [self._decode_state(n) for n in self.nodes]

    def _decode_state(self, node: _Node) -> DecodeInstanceState:
        placed = [*node.batch.members, *node.waiting, *([node.chunk[0]] if node.chunk is not None else [])]
        decoders = [tokens for rid in placed if is_decoder(tokens := self.trace[rid].output_length)]
        pace = node.batch.pace(self.now)
        return DecodeInstanceState(
            node.id, len(placed), node.batch.context, self.profile.decode_capacity_tokens, interleaves_prefill=True,
            measured=None if pace is None else MeasuredStep(pace.batch, pace.kv_tokens, pace.seconds),
            queued_prefill_s=node.pending_s, paced_prefill_s=sum(self._predicted[rid] for rid in placed if rid in self._step_target),
            decoders_tokens=sum(decoders) / len(decoders) if decoders else 0.0,
            prompt_excess_s=0.0 if pace is None else pace.prompt_s, paces_prompts=self.chunked)

    @property
    def index(self) -> BlockIndex:
        return self.cache.index if self.cache is not None else self._empty_index

    def _arrive(self, rid: int) -> None:
        req = self.trace[rid]
        route = RouteRequest(req.hash_ids, req.input_length, self.cfg.block_size, req.output_length,
                             waited_s=self.waited_s(rid))
        if self.scheduler is None:
            choice = self.router.choose(route, self.prefill_states(), self.index)
            self.enqueue(choice.instance_id, rid, choice.prefill_s)
            return
        decision = self.scheduler.schedule(route, self.prefill_states(), self.decode_states(), self.index, self.now)
        if not decision.accepted:
            self.turn_away(rid, decision.clears_in_s)
            return
        assert decision.prefill is not None, "an accepted decision carries its prefill choice"
        self.enqueue(decision.prefill.instance_id, rid, decision.prefill.prefill_s,
                     decision.step_target_s)

    def enqueue(self, node_id: str, rid: int, predicted_prefill_s: float, step_target_s: float = 0.0) -> None:
        """Queue request ``rid`` on node ``node_id`` to prefill (predicted to take ``predicted_prefill_s``), then
        decode; ``step_target_s`` (0: not paced) paces its prompt."""
        req = self.trace[rid]
        if step_target_s:
            self._step_target[rid] = step_target_s
        node = self.nodes[int(node_id[1:])]
        node.pending_s += predicted_prefill_s
        self._predicted[rid] = predicted_prefill_s
        node.waiting.append(rid)
        node.waiting_tokens += req.input_length
        if node.kind == PREFILLING:
            return
        batch = node.batch
        if node.kind == DECODING and batch.t0 <= self.now:
            k, _ = batch.boundary_after(self.now)
            self.decoded(batch, batch.close(k))
        elif node.kind == IDLE:
            batch.t0 = max(batch.t0, self.now)
        self._next(node)

    def _cached_tokens(self, node: _Node, rid: int) -> int:
        if self.cache is None:
            return 0
        req = self.trace[rid]
        cache = self.cache.node(node.id)
        blocks = cache.match(req.hash_ids)
        self.out.hit_blocks[rid] = blocks
        if blocks:
            cache.touch(req.hash_ids[:blocks], self.now)
        return RouteRequest(req.hash_ids, req.input_length, self.cfg.block_size).cached_tokens(blocks)

    def _fits(self, node: _Node, extra_context: int, rid: int) -> bool:
        batch = node.batch
        return (not batch.members and not extra_context) or (
            batch.context + extra_context + self.trace[rid].input_length <= self.profile.decode_capacity_tokens
        )

    def _next(self, node: _Node) -> None:
        batch, prefill = node.batch, self.cost.prefill
        node.version += 1
        end = None
        if self.chunked:
            if node.chunk is None and node.waiting and self._fits(node, 0, node.waiting[0]):
                rid = node.waiting.popleft()
                cached = self._cached_tokens(node, rid)
                node.chunk = [rid, cached, cached]
            if node.chunk is not None:
                rid, done, _ = node.chunk
                left = self.trace[rid].input_length - done
                size = min(self._chunk_tokens(node, rid, done), left)
                steps = left // size if left >= size else 1
                growth = prefill.coef[3] * size * size if steps > 1 else 0.0
                node.extra = (prefill.predict(size, done), growth, size)
                end = batch.begin(batch.t0, node.extra[0], growth, steps)
        elif node.waiting and self._fits(node, 0, node.waiting[0]):
            budget, total, extra_ctx = self.cfg.max_batched_tokens, 0.0, 0
            while node.waiting and self._fits(node, extra_ctx, node.waiting[0]):
                rid = node.waiting[0]
                if node.job and self.trace[rid].input_length > budget:
                    break
                node.waiting.popleft()
                cached = self._cached_tokens(node, rid)
                seconds = prefill.predict(self.trace[rid].input_length - cached, cached)
                self.out.prefill_s[rid] = seconds
                node.job.append((rid, cached))
                budget -= self.trace[rid].input_length
                extra_ctx += self.trace[rid].input_length
                total += seconds
            node.extra = (total, 0.0, 0)
            end = batch.begin(batch.t0, total, 0.0, 1)
        if end is None:
            node.kind = DECODING if batch.begin(batch.t0) is not None else IDLE
            end = batch.t0 + batch.elapsed(batch.kmax) if node.kind == DECODING else None
        else:
            node.kind = PREFILLING
        if end is not None:
            self.push(end, EPOCH, node.idx, node.version)

    def _chunk_tokens(self, node: _Node, rid: int, done: int) -> int:
        """Tokens of ``rid``'s prompt a step computes from ``done`` on: the chunk size, or for a paced prompt
        beside decoding sequences what its step target leaves of their step (as the engine's ``StepBudget``
        sizes it, at least a block), at the chunk's cost per token where it starts."""
        target = self._step_target.get(rid, 0.0)
        if not target or not node.batch.members:
            return self.cfg.chunk_tokens
        room = target - self.cost.decode.predict(len(node.batch.members), node.batch.context)
        per_token = self.cost.prefill.predict(self.cfg.chunk_tokens, done) / self.cfg.chunk_tokens
        return max(self.cfg.block_size, min(self.cfg.chunk_tokens, int(room / per_token)))

    def _epoch_end(self, node: _Node) -> None:
        batch = node.batch
        started, k, decoding = batch.t0, batch.kmax, len(batch.members)
        first, growth, size = node.extra
        self.decoded(batch, batch.close(k))
        if node.kind == PREFILLING and self.chunked:
            chunk = node.chunk
            assert chunk is not None, "a chunked node prefilling holds its chunk"
            rid = chunk[0]
            self.out.prefill_s[rid] += k * first + growth * k * (k - 1) / 2
            self._computed[rid] = self._computed.get(rid, 0.0) + (batch.t0 - started) * size / (size + decoding)
            chunk[1] += k * size
            if chunk[1] >= self.trace[rid].input_length:
                node.chunk = None
                self._prefilled(node, rid, batch.t0, chunk[2])
        elif node.kind == PREFILLING:
            tokens = {rid: self.trace[rid].input_length - cached for rid, cached in node.job}
            for rid, cached in node.job:
                self._computed[rid] = (batch.t0 - started) * tokens[rid] / (sum(tokens.values()) + decoding)
                self._prefilled(node, rid, started + first, cached)
            node.job = []
        node.extra = (0.0, 0.0, 0)
        self._next(node)

    def _prefilled(self, node: _Node, rid: int, t: float, cached: int) -> None:
        req = self.trace[rid]
        node.pending_s -= self._predicted.pop(rid)
        self._step_target.pop(rid, None)
        computed = self._computed.pop(rid)
        if self.prefill_fitter is not None:
            self.prefill_fitter.record(req.input_length - cached, cached, computed)
        node.waiting_tokens -= req.input_length
        node.recent_ttft.add(t, t - self.out.arrival[rid])
        if self.cache is not None:
            self.cache.node(node.id).insert(req.hash_ids[: req.input_length // self.cfg.block_size], t)
        if self.first_token(rid, t):
            node.batch.add(rid, req.input_length, req.output_length - 1, t)
