"""What bounds each process's resident memory (RSS): the parts its configuration and what it loaded fix,
plus a measured baseline for the interpreter and its libraries.

Every service reports its own parts (:class:`MemoryReport`, in its ready file); :func:`deployment_bounds`
adds what only the deployment knows: the transfer nodes' shared-memory segments, which every engine on
their host maps (RSS counts each page of a mapping once the process touches it), and the cache-manager's
index, which grows with the blocks the pool's tiers hold until they are full.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

MIB = 1 << 20

# Measured (docs/RELIABILITY.md, "What bounds each process's memory"): RSS of each role right after
# start, on the tiny model, rounded up with headroom for allocator slack (glibc arenas, torch's CPU
# allocator) and the first requests' imports and buffers.
BASELINE_BYTES: Mapping[str, int] = {
    "gateway": 512 * MIB,  # the tokenizer and the HTTP stack
    "conductor": 192 * MIB,
    "cache-manager": 192 * MIB,
    "transfer": 192 * MIB,
    # prefill, decode, aggregated, besides weights, KV cache and a step's tensors: ~400 MiB (tiny model) to
    # ~850 MiB (SmolLM2, ~530 of it torch's shared libraries as its kernels touch them) after start
    "engine": 1024 * MIB,
}
ENGINE_ROLES = frozenset({"prefill", "decode", "aggregated"})
INDEX_BYTES_PER_BLOCK = 1024  # the cache-manager's index, per block held (~600 measured, tests/kv)


class MemoryReport(msgspec.Struct, frozen=True, kw_only=True):
    """One process's own share of its bound, in bytes per part, and what it adds to others' bounds:
    ``segment_bytes`` (a transfer node's DRAM segment, mapped by engines on its host), ``pool_bytes``
    (the blocks its tiers hold, indexed by the cache-manager) and ``block_bytes`` (an engine's KV block)."""

    role: str
    parts: dict[str, int]
    segment_bytes: int = 0
    pool_bytes: int = 0
    block_bytes: int = 0

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        """The parts, largest first, in MiB: what the bound is made of."""
        ordered = sorted(self.parts.items(), key=lambda item: -item[1])
        return " + ".join(f"{name} {nbytes / MIB:,.0f}" for name, nbytes in ordered)


def baseline(role: str) -> int:
    return BASELINE_BYTES["engine" if role in ENGINE_ROLES else role]


def engine_report(role: str, *, weights_bytes: int, kv_cache_bytes: int, working_bytes: int,
                  block_bytes: int) -> MemoryReport:
    """An engine process: the weights and KV cache resident in host memory (0 for those on a GPU) and a
    step's working memory. Its prefix cache is blocks of its KV cache, so it has no bound of its own."""
    return MemoryReport(role=role, parts={"baseline": baseline(role), "weights": weights_bytes,
                                          "KV cache": kv_cache_bytes, "step": working_bytes},
                        block_bytes=block_bytes)


def service_report(role: str, parts: Mapping[str, int] | None = None, *, segment_bytes: int = 0,
                   pool_bytes: int = 0) -> MemoryReport:
    """A process without an engine: its baseline plus ``parts`` (a transfer node: its segment)."""
    return MemoryReport(role=role, parts={"baseline": baseline(role), **(parts or {})},
                        segment_bytes=segment_bytes, pool_bytes=pool_bytes)


def deployment_bounds(reports: Mapping[str, MemoryReport]) -> dict[str, MemoryReport]:
    """Each process's whole bound, all on one host: an engine may map every transfer node's segment (the
    shm path), and the cache-manager indexes at most the blocks the tiers hold, of the smallest block size
    reported (none reported: no engine, no blocks)."""
    segments = sum(r.segment_bytes for r in reports.values())
    pool = sum(r.pool_bytes for r in reports.values())
    blocks = [r.block_bytes for r in reports.values() if r.block_bytes]
    index = pool // min(blocks) * INDEX_BYTES_PER_BLOCK if blocks else 0
    bounds = {}
    for name, report in reports.items():
        extra = ({"transfer segments": segments} if report.role in ENGINE_ROLES and segments
                 else {"pool index": index} if report.role == "cache-manager" and index else {})
        bounds[name] = msgspec.structs.replace(report, parts={**report.parts, **extra})
    return bounds
