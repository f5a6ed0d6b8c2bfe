"""What ``HalfmoonConnector`` did with the pool, as vLLM's connector statistics: counted by both of its
sides, summed by vLLM's scheduler each step, logged with vLLM's throughput lines (``KV Transfer
metrics: ...``) and exported on vLLM's ``/metrics`` as ``vllm:halfmoon_pool_*_total`` counters, one per
engine.

The counts are of tokens where vLLM counts tokens (its prefix-cache metrics) and of blocks where a
block is what happened (a pool block stored, a vLLM block recomputed)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

COUNTERS: dict[str, str] = {
    "lookup_tokens": "Prompt tokens beyond vLLM's own prefix cache that the scheduler looked up in Halfmoon's pool",
    "hit_tokens": "Prompt tokens beyond vLLM's own prefix cache that Halfmoon's pool held (vLLM loads them)",
    "loaded_tokens": "Tokens whose KV was copied from Halfmoon's pool into vLLM's cache",
    "load_error_blocks": "vLLM blocks whose pool KV was missing or failed its MAC (vLLM recomputes them)",
    "stored_blocks": "Blocks vLLM computed and stored in Halfmoon's pool",
}


class HalfmoonConnectorStats(KVConnectorStats):
    """Counts since the last report, one entry per name in ``COUNTERS``; a missing name is zero (a side
    reports only its own)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, count in other.data.items():
            self.data[name] = self.data.get(name, 0) + count
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data.get(name, 0) for name in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsCounter:
    """Counts from any thread (the connector's pool calls end on its session's loop), taken as a report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, name: str, count: int) -> None:
        assert name in COUNTERS, name
        if count:
            with self._lock:
                self._counts[name] = self._counts.get(name, 0) + count

    def take(self) -> HalfmoonConnectorStats | None:
        with self._lock:
            counts, self._counts = self._counts, {}
        return HalfmoonConnectorStats(data=counts) if counts else None


class HalfmoonPromMetrics(KVConnectorPromMetrics):
    """``vllm:halfmoon_pool_<name>`` counters, labelled by engine as vLLM's own."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, documentation in COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:halfmoon_pool_{name}", documentation=documentation,
                                        labelnames=labelnames)
            self._counters[name] = {engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, count in transfer_stats_data.items():
            if name in self._counters and count:
                self._counters[name][engine_idx].inc(count)
