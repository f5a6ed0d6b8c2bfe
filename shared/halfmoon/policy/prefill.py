"""Prefill instance choice: the paper's baselines and its KVCache-centric Algorithm 1."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import NamedTuple

from halfmoon.policy.cost import CostModels
from halfmoon.policy.state import (
    SLO,
    BlockIndex,
    PrefillInstanceState,
    RouteRequest,
    pool_prefix_length,
    prefix_lengths,
    slo_attainment,
)


class NoPrefillInstanceError(ValueError):
    """The prefill pool is empty."""


class PrefillChoice(NamedTuple):
    """Where to prefill, the predicted TTFT split in parts, and which blocks to pull from whom.

    ``prefix_blocks`` counts the reused prefix (local plus pulled); pulling replicates the
    blocks on the chosen instance, which is how hot blocks spread. ``ttft_s`` is the sum of the parts
    until the scheduler calibrates it to the TTFTs delivered.
    """

    instance_id: str
    ttft_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float
    prefix_blocks: int
    pulls: tuple[tuple[Hashable, str], ...] = ()


class PrefillPolicy(ABC):
    """Picks one prefill instance for a request.

    Contract: ``choose`` is pure given its inputs (random policies own a seeded generator),
    never mutates the states or the index, and raises ``NoPrefillInstanceError`` for an empty
    pool. The predicted TTFT is queue wait + transfer + prefill of the tokens not reused.
    """

    def __init__(self, cost: CostModels, slo: SLO = SLO()) -> None:
        self.cost = cost
        self.slo = slo

    @abstractmethod
    def choose(
        self, request: RouteRequest, instances: Sequence[PrefillInstanceState], index: BlockIndex
    ) -> PrefillChoice: ...

    def _local(self, request: RouteRequest, inst: PrefillInstanceState, prefix: int) -> PrefillChoice:
        cached = request.cached_tokens(prefix)
        prefill = self.cost.prefill.predict(request.prompt_tokens - cached, cached)
        return PrefillChoice(inst.id, inst.queue_seconds + prefill, inst.queue_seconds, prefill, 0.0, prefix)

    @staticmethod
    def _require(instances: Sequence[PrefillInstanceState]) -> None:
        if not instances:
            raise NoPrefillInstanceError("no prefill instance to choose from")


class RandomPrefill(PrefillPolicy):
    def __init__(self, cost: CostModels, slo: SLO = SLO(), seed: int = 0) -> None:
        super().__init__(cost, slo)
        self._rng = random.Random(seed)

    def choose(self, request, instances, index):
        self._require(instances)
        inst = instances[self._rng.randrange(len(instances))]
        prefix = prefix_lengths(request.block_keys, index, (inst.id,)).get(inst.id, 0)
        return self._local(request, inst, prefix)


class LeastLoadedPrefill(PrefillPolicy):
    """Load balancing, ignoring caches: the lowest load, where load is the recent TTFT-SLO
    violation rate plus the queue wait as a share of the TTFT SLO.

    Summing (rather than ranking by violations first) matters: violations are only seen
    after a prefill ends, so ranking by them first herds every request onto whichever
    instance has not reported a violation yet.
    """

    def load(self, s: PrefillInstanceState) -> float:
        return (1.0 - slo_attainment(s.recent_ttft, self.slo.ttft_s)) + s.queue_seconds / self.slo.ttft_s

    def choose(self, request, instances, index):
        self._require(instances)
        inst = min(instances, key=lambda s: (self.load(s), s.queue_tokens))
        prefix = prefix_lengths(request.block_keys, index, (inst.id,)).get(inst.id, 0)
        return self._local(request, inst, prefix)


class LocalCacheAwarePrefill(PrefillPolicy):
    """Section 4.1: lowest queue wait + prefill time given each instance's own prefix match.

    Ties (common while queues are empty) go to the instance with the fewest queued tokens."""

    def choose(self, request, instances, index):
        self._require(instances)
        lengths = prefix_lengths(request.block_keys, index, [s.id for s in instances])
        tokens = {s.id: s.queue_tokens for s in instances}
        return min(
            (self._local(request, s, lengths.get(s.id, 0)) for s in instances),
            key=lambda c: (c.ttft_s, tokens[c.instance_id]),
        )


class GlobalCacheAwarePrefill(PrefillPolicy):
    """Algorithm 1 with cache load balancing (section 4.2).

    An instance may pull the blocks it lacks from their holders when the pool's best match
    exceeds ``balancing_threshold`` times its local match and the transfer is cheaper than
    recomputing those tokens; otherwise it recomputes. Blocks come from the instance with the
    longest match when it holds them, else from the first holder by id.
    """

    def __init__(self, cost: CostModels, slo: SLO = SLO(), balancing_threshold: float = 1.0) -> None:
        super().__init__(cost, slo)
        if balancing_threshold < 1.0:
            raise ValueError(f"balancing_threshold must be >= 1, got {balancing_threshold}")
        self.threshold = balancing_threshold

    def choose(self, request, instances, index):
        self._require(instances)
        keys = request.block_keys
        lengths = prefix_lengths(keys, index, [s.id for s in instances])
        best_len = pool_prefix_length(keys, index)
        best_holder = max(lengths, key=lengths.__getitem__, default=None)
        cached_best = request.cached_tokens(best_len)
        prefill_best = self.cost.prefill.predict(request.prompt_tokens - cached_best, cached_best)
        choice: PrefillChoice | None = None
        pull_from = 0
        best_key = (0.0, 0)
        for inst in instances:
            local = lengths.get(inst.id, 0)
            candidate = self._local(request, inst, local)
            if best_len > local and best_len > self.threshold * local:
                transfer = self.cost.transfer.seconds(cached_best - request.cached_tokens(local))
                if transfer + prefill_best < candidate.prefill_s:
                    ttft = inst.queue_seconds + transfer + prefill_best
                    candidate = PrefillChoice(inst.id, ttft, inst.queue_seconds, prefill_best, transfer, best_len)
            key = (candidate.ttft_s, inst.queue_tokens)
            if choice is None or key < best_key:
                choice, pull_from, best_key = candidate, local, key
        assert choice is not None
        if choice.prefix_blocks == pull_from:
            return choice
        pulls = tuple(
            (key, self._source(index[key], best_holder, lengths, i)) for i, key in enumerate(keys[pull_from:choice.prefix_blocks], start=pull_from)
        )
        return choice._replace(pulls=pulls)

    @staticmethod
    def _source(holders, best_holder: str | None, lengths: dict[str, int], position: int) -> str:
        if best_holder is not None and lengths[best_holder] > position:
            return best_holder
        return min(holders)


PREFILL_POLICIES: dict[str, type[PrefillPolicy]] = {
    "random": RandomPrefill,
    "load-balancing": LeastLoadedPrefill,
    "local-cache-aware": LocalCacheAwarePrefill,
    "global-cache-aware": GlobalCacheAwarePrefill,
}


def make_prefill_policy(name: str, cost: CostModels, slo: SLO = SLO(), **kwargs: float) -> PrefillPolicy:
    try:
        cls = PREFILL_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown prefill policy {name!r}; choose from {sorted(PREFILL_POLICIES)}") from None
    return cls(cost, slo, **kwargs)
