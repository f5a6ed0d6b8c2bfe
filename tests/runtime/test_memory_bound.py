"""Each process's memory bound (runtime/memory.py): its own parts, and what the deployment adds to them."""

from __future__ import annotations

from halfmoon.runtime.memory import (
    BASELINE_BYTES,
    INDEX_BYTES_PER_BLOCK,
    MIB,
    MemoryReport,
    deployment_bounds,
    engine_report,
    service_report,
)

SEGMENT, NVME = 64 * MIB, 256 * MIB


def deployment(block_bytes: tuple[int, ...] = (64 << 10, 16 << 10)) -> dict[str, MemoryReport]:
    engines = {f"{role}-0": engine_report(role, weights_bytes=10 * MIB, kv_cache_bytes=100 * MIB, working_bytes=MIB,
                                          block_bytes=size) for role, size in zip(("prefill", "decode"), block_bytes)}
    nodes = {f"transfer-{i}": service_report("transfer", {"DRAM segment": SEGMENT}, segment_bytes=SEGMENT,
                                             pool_bytes=SEGMENT + NVME) for i in range(2)}
    return {**engines, **nodes, "cache-manager-0": service_report("cache-manager"),
            "gateway-0": service_report("gateway")}


class TestDeploymentBounds:
    def test_an_engine_may_map_every_transfer_nodes_segment(self) -> None:
        bounds = deployment_bounds(deployment())
        for engine in ("prefill-0", "decode-0"):
            assert bounds[engine].parts["transfer segments"] == 2 * SEGMENT
            assert bounds[engine].total == BASELINE_BYTES["engine"] + 111 * MIB + 2 * SEGMENT

    def test_the_cache_manager_indexes_every_block_the_tiers_hold_at_the_smallest_block_size(self) -> None:
        bounds = deployment_bounds(deployment())
        blocks = 2 * (SEGMENT + NVME) // (16 << 10)
        assert bounds["cache-manager-0"].parts["pool index"] == blocks * INDEX_BYTES_PER_BLOCK

    def test_the_others_keep_their_own_parts(self) -> None:
        reports = deployment()
        bounds = deployment_bounds(reports)
        for name in ("transfer-0", "transfer-1", "gateway-0"):
            assert bounds[name] == reports[name]
        assert bounds["transfer-0"].total == BASELINE_BYTES["transfer"] + SEGMENT

    def test_without_engines_nothing_is_added(self) -> None:
        reports = {k: v for k, v in deployment().items() if not k.startswith(("prefill", "decode"))}
        assert deployment_bounds(reports) == reports

    def test_describe_names_every_part_largest_first(self) -> None:
        bound = deployment_bounds(deployment())["prefill-0"]
        assert bound.describe() == "baseline 1,024 + transfer segments 128 + KV cache 100 + weights 10 + step 1"
