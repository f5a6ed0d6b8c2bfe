"""Cache-only replay (the paper's Figure 9 analysis): requests in order, one cache, no timing."""

from __future__ import annotations

from collections.abc import Sequence

from halfmoon.sim.cache import ClusterCache
from halfmoon.sim.trace import TraceRequest


def cache_hit_rate(trace: Sequence[TraceRequest], capacity_blocks: int | None, eviction: str, block_size: int = 512) -> float:
    """Share of prompt blocks found as a cached prefix when every request's full blocks are
    stored after it is served; ignores compute time and replication, as Figure 9 does."""
    cache = ClusterCache(["pool"], capacity_blocks, eviction).node("pool")
    hits = total = 0
    for i, req in enumerate(trace):
        keys = req.hash_ids
        hits += cache.match(keys)
        total += len(keys)
        cache.insert(keys[: req.input_length // block_size], float(i))
    return hits / total if total else 0.0
