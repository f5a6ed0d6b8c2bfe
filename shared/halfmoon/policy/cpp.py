"""Chunked pipeline-parallel prefill (the paper's CPP): when to use it and what it gains.

A long prompt is cut into chunks that flow through ``k`` prefill instances, each holding a
contiguous ``1/k`` of the layers. A chunk's time on one stage is the cost model's time for
that chunk (on top of the tokens before it) divided by ``k``; between stages a chunk's
activations cross the network (one hop: latency + tokens x hidden-state bytes / bandwidth).
Stage ``s`` starts chunk ``j`` once it finished chunk ``j-1`` and chunk ``j`` arrived from
stage ``s-1``, so the prompt finishes after roughly one pass of the pipeline plus ``1/k`` of the
single-node time. Each stage pulls its layers' share of the reused prefix in parallel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from halfmoon.policy.cost import CostModels
from halfmoon.policy.prefill import PrefillChoice
from halfmoon.policy.state import PrefillInstanceState


class CppSettings(NamedTuple):
    """``stages`` instances per pipeline, prompts of at least ``min_tokens`` are candidates, cut
    into chunks of ``chunk_tokens``; ``hop_bytes_per_token`` is the hidden state passed between
    stages (hidden size x dtype bytes: 8192 x 2 for a 70B model in BF16). With
    ``min_single_ttft_s`` > 0 a pipeline is used only for prompts whose best single node would
    take at least that long (e.g. the TTFT SLO: CPP as a rescue, never taking nodes otherwise)."""

    stages: int = 4
    chunk_tokens: int = 4096
    min_tokens: int = 32768
    hop_bytes_per_token: int = 16384
    min_single_ttft_s: float = 0.0

    def check(self) -> None:
        if self.stages < 2 or self.chunk_tokens < 1 or self.min_tokens < 1 or min(self.hop_bytes_per_token,
                                                                                  self.min_single_ttft_s) < 0:
            raise ValueError(f"CPP needs >= 2 stages and positive sizes, got {self}")


DEFAULT_SETTINGS = CppSettings()


class CppPlan(NamedTuple):
    """A pipelined prefill: its stages (first = the instance the single-node choice picked),
    the predicted TTFT split in parts, and the TTFT it saves against the single-node choice."""

    stages: tuple[str, ...]
    ttft_s: float
    queue_s: float
    transfer_s: float
    prefill_s: float
    gain_s: float


def pipeline_seconds(
    cost: CostModels, new_tokens: int, cached_tokens: int, stages: int, chunk_tokens: int, hop_bytes_per_token: int
) -> float:
    """Seconds from the first chunk entering stage 0 to the last leaving stage ``stages-1``."""
    if new_tokens <= 0:
        return 0.0
    transfer = cost.transfer
    finish = [0.0] * stages  # finish[s]: when stage s finished its latest chunk
    done_before = 0
    for _ in range(math.ceil(new_tokens / chunk_tokens)):
        chunk = min(chunk_tokens, new_tokens - done_before)
        per_stage = cost.prefill.predict(chunk, cached_tokens + done_before) / stages
        hop = transfer.latency_s + chunk * hop_bytes_per_token / transfer.bandwidth_bytes_per_s
        arrived = 0.0
        for s in range(stages):
            finish[s] = max(finish[s], arrived) + per_stage
            arrived = finish[s] + hop
        done_before += chunk
    return finish[-1]


class CppPolicy:
    """Contract: pure; ``plan`` returns a pipeline for a prompt of at least ``min_tokens`` when
    the pool has ``stages`` instances, ``single`` takes at least ``min_single_ttft_s`` and the
    pipeline's predicted TTFT beats it (waiting for the busiest stage included); otherwise None,
    and the single node prefills."""

    def __init__(self, cost: CostModels, settings: CppSettings = DEFAULT_SETTINGS) -> None:
        settings.check()
        self.cost = cost
        self.settings = settings

    def plan(
        self, prompt_tokens: int, cached_tokens: int, single: PrefillChoice, instances: Sequence[PrefillInstanceState]
    ) -> CppPlan | None:
        k = self.settings.stages
        if prompt_tokens < self.settings.min_tokens or len(instances) < k:
            return None
        if single.ttft_s < self.settings.min_single_ttft_s:
            return None
        head = next(s for s in instances if s.id == single.instance_id)
        others = sorted((s for s in instances if s.id != head.id), key=lambda s: (s.queue_seconds, s.queue_tokens))
        group = [head, *others[: k - 1]]
        queue = max(s.queue_seconds for s in group)
        transfer = self.cost.transfer.seconds(cached_tokens / k) if cached_tokens else 0.0
        prefill = pipeline_seconds(self.cost, prompt_tokens - cached_tokens, cached_tokens, k,
                                   self.settings.chunk_tokens, self.settings.hop_bytes_per_token)
        ttft = queue + transfer + prefill
        if ttft >= single.ttft_s:
            return None
        return CppPlan(tuple(s.id for s in group), ttft, queue, transfer, prefill, single.ttft_s - ttft)
