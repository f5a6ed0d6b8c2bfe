"""Simulator speed: requests replayed per wall second on the full conversation trace, 16 nodes.

Run: python -m benchmarks.sim_throughput
The budget in the issue is the whole trace (12,031 requests) in under 60 s, i.e. >= 200
requests per wall second; each line reports the ratio to that budget.
"""

from __future__ import annotations

import time

from halfmoon.cli.sim import DEFAULT_TRACE
from halfmoon.sim.config import SimConfig
from halfmoon.sim.profile import load_profile
from halfmoon.sim.run import simulate
from halfmoon.sim.trace import load_trace

BUDGET_S = 60.0
SYSTEMS = {
    "halfmoon 8P+8D global-cache-aware": SimConfig(pool_blocks=8 * 5859),
    "halfmoon 8P+8D predictive admission": SimConfig(pool_blocks=8 * 5859, admission="predictive"),
    "coupled 16 plain": SimConfig(mode="coupled", prefill_nodes=16, decode_nodes=0),
    "coupled 16 prefix": SimConfig(mode="coupled", prefill_nodes=16, decode_nodes=0, coupled_variant="prefix",
                                   coupled_router="local-cache-aware"),
    "coupled 16 chunked": SimConfig(mode="coupled", prefill_nodes=16, decode_nodes=0, coupled_variant="chunked"),
}


def measure() -> dict[str, tuple[float, float]]:
    """System -> (wall seconds including trace load, requests per wall second)."""
    profile = load_profile()
    out = {}
    for name, config in SYSTEMS.items():
        started = time.perf_counter()
        trace = load_trace(DEFAULT_TRACE)
        simulate(config, profile, trace)
        wall = time.perf_counter() - started
        out[name] = (wall, len(trace) / wall)
    return out


def main() -> None:
    print("full conversation trace (12,031 requests), wall time including trace parsing")
    for name, (wall, rate) in measure().items():
        print(f"  {name:38s} {wall:6.2f} s  {rate:8.0f} req/s  ({BUDGET_S / wall:5.1f}x faster than the 60 s budget)")


if __name__ == "__main__":
    main()
