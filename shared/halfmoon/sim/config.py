"""One validated configuration object per simulator run."""

from __future__ import annotations

from dataclasses import dataclass, field

from halfmoon.policy.admission import ADMISSION_POLICIES, OVERLOAD_WAIT_S
from halfmoon.policy.cpp import CppSettings
from halfmoon.policy.eviction import EVICTION_POLICIES
from halfmoon.policy.prefill import PREFILL_POLICIES
from halfmoon.policy.state import SLO

COUPLED_VARIANTS = ("plain", "prefix", "chunked")
MODES = ("disaggregated", "coupled", "mixed")


class SimConfigError(ValueError):
    """A simulator setting is out of range or names an unknown policy."""


@dataclass(frozen=True)
class SimConfig:
    """``mode`` is ``disaggregated`` (``prefill_nodes`` + ``decode_nodes``, the Halfmoon design),
    ``coupled`` (``prefill_nodes + decode_nodes`` nodes that each prefill and decode, vLLM-like), or
    ``mixed``: the disaggregated pools plus ``aggregated_nodes`` nodes that each prefill (chunked, with a
    prefix cache in HBM) and decode, the Conductor handing each request off or serving it whole by
    predicted cost (policy/disaggregation.py; ``handoff_overhead_s`` is its fixed cost of a hand-off).

    ``pool_blocks`` is the KVCache pool capacity in blocks, split evenly over the nodes that
    cache (prefill nodes, or every coupled node); None means unbounded. ``time_scale`` > 1
    replays the trace faster. ``coupled_router`` is the prefill policy coupled nodes are chosen by.
    ``cpp_stages`` >= 2 lets the Conductor prefill prompts of at least ``cpp_min_tokens`` on a
    pipeline of that many prefill nodes (chunked pipeline parallelism; disaggregated mode only);
    0 turns it off. ``overload_wait_s``: a request turned away as overloaded that the conductor expects to let
    in within this long asks again, as the gateway's does (``overload_pause``); 0 answers it at once, as the
    paper's system does.
    """

    mode: str = "disaggregated"
    prefill_nodes: int = 8
    decode_nodes: int = 8
    prefill_policy: str = "global-cache-aware"
    admission: str = "none"
    eviction: str = "lru"
    pool_blocks: int | None = None
    block_size: int = 512
    time_scale: float = 1.0
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    balancing_threshold: float = 1.0
    coupled_variant: str = "plain"
    coupled_router: str = "load-balancing"
    chunk_tokens: int = 512
    max_batched_tokens: int = 131072
    expected_decode_s: float = 10.0
    cpp_stages: int = 0
    cpp_chunk_tokens: int = 4096
    cpp_min_tokens: int = 32768
    cpp_hop_bytes_per_token: int = 16384
    cpp_min_single_ttft_s: float = 0.0
    aggregated_nodes: int = 0
    handoff_overhead_s: float = 0.02
    overload_wait_s: float = OVERLOAD_WAIT_S

    def __post_init__(self) -> None:
        checks = [
            (self.mode in MODES, f"mode must be one of {MODES}, got {self.mode!r}"),
            (self.prefill_nodes >= 1, "prefill_nodes must be >= 1"),
            (self.decode_nodes >= (0 if self.mode == "coupled" else 1), "decode_nodes must be >= 1"),
            ((self.aggregated_nodes >= 1) == (self.mode == "mixed"), "aggregated_nodes must be >= 1 in mixed mode "
             "and 0 otherwise"),
            (self.handoff_overhead_s >= 0, "handoff_overhead_s must be >= 0"),
            (self.overload_wait_s >= 0, "overload_wait_s must be >= 0"),
            (self.prefill_policy in PREFILL_POLICIES, f"unknown prefill policy {self.prefill_policy!r}"),
            (self.coupled_router in PREFILL_POLICIES, f"unknown coupled router {self.coupled_router!r}"),
            (self.admission in ADMISSION_POLICIES, f"unknown admission policy {self.admission!r}"),
            (self.eviction in EVICTION_POLICIES, f"unknown eviction policy {self.eviction!r}"),
            (self.pool_blocks is None or self.pool_blocks >= 0, "pool_blocks must be >= 0 or None"),
            (self.block_size >= 1, "block_size must be >= 1"),
            (self.time_scale > 0, "time_scale must be > 0"),
            (self.balancing_threshold >= 1.0, "balancing_threshold must be >= 1"),
            (self.coupled_variant in COUPLED_VARIANTS, f"coupled_variant must be one of {COUPLED_VARIANTS}"),
            (self.chunk_tokens >= 1 and self.max_batched_tokens >= 1, "token budgets must be >= 1"),
            (self.expected_decode_s > 0, "expected_decode_s must be > 0"),
            (self.cpp_stages == 0 or 2 <= self.cpp_stages <= self.prefill_nodes,
             "cpp_stages must be 0 (off) or between 2 and the number of prefill nodes"),
            (self.cpp_stages == 0 or self.mode != "coupled", "CPP needs prefill nodes (disaggregated or mixed mode)"),
            (self.cpp_chunk_tokens >= 1 and self.cpp_min_tokens >= 1 and self.cpp_hop_bytes_per_token >= 0
             and self.cpp_min_single_ttft_s >= 0,
             "CPP sizes must be positive"),
        ]
        for ok, message in checks:
            if not ok:
                raise SimConfigError(message)

    @property
    def total_nodes(self) -> int:
        return self.prefill_nodes + self.decode_nodes + self.aggregated_nodes

    def cpp_settings(self) -> CppSettings | None:
        if not self.cpp_stages:
            return None
        return CppSettings(self.cpp_stages, self.cpp_chunk_tokens, self.cpp_min_tokens, self.cpp_hop_bytes_per_token,
                           self.cpp_min_single_ttft_s)

    def per_node_blocks(self, caching_nodes: int) -> int | None:
        return None if self.pool_blocks is None else self.pool_blocks // caching_nodes
