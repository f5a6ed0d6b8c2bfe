"""How far a paced prompt may take the steps it shares: `PACED_STEP_SHARE` swept in the simulator.

Six coupled nodes with chunked prefill, the Conductor's predictive admission, the Mooncake trace: each share
is run with requests turned away at once and with the gateway's wait. A share whose target sits below the
nodes' decode step paces nothing, so those rows equal a run without pacing.

    python -m benchmarks.sim_paced_share [--limit 3000] [--tbt-slo 0.1]
"""

from __future__ import annotations

import argparse

import halfmoon.policy.decode as decode_policy
from halfmoon.cli.sim import DEFAULT_TRACE
from halfmoon.policy.admission import OVERLOAD_WAIT_S
from halfmoon.policy.state import SLO
from halfmoon.sim.config import SimConfig
from halfmoon.sim.profile import load_profile
from halfmoon.sim.run import simulate
from halfmoon.sim.trace import load_trace

SHARES = (0.5, 0.6, 0.75, 0.9, 1.0)
MET_TBT_S = 0.2  # the figure compared: requests meeting TTFT 30 s and a slowest-10% TBT of 200 ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=3000, help="replay the first N requests of the trace")
    p.add_argument("--tbt-slo", type=float, default=0.1, help="the TBT SLO admission keeps (s)")
    p.add_argument("--nodes", type=int, default=6)
    args = p.parse_args()
    trace, profile = load_trace(DEFAULT_TRACE, args.limit), load_profile()
    print(f"{len(trace)} requests, {args.nodes} chunked coupled nodes, TBT SLO {args.tbt_slo * 1000:.0f} ms")
    print("| share | wait (s) | turned away | waited | met TTFT 30 s, TBT 200 ms | TTFT p50 (s) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for share in SHARES:
        decode_policy.PACED_STEP_SHARE = share  # read by SloAwareDecode.paced_step_s at each decision
        for wait in (0.0, OVERLOAD_WAIT_S):
            config = SimConfig(mode="coupled", prefill_nodes=args.nodes, decode_nodes=0, coupled_variant="chunked",
                               coupled_router="load-balancing", admission="predictive", slo=SLO(tbt_s=args.tbt_slo),
                               overload_wait_s=wait)
            result = simulate(config, profile, trace)
            s = result.summary
            print(f"| {share:.2f} | {wait:.0f} | {s.rejected_early + s.rejected_late:,} | {s.waited:,} "
                  f"| {result.outcomes.capacity(config.slo.ttft_s, MET_TBT_S):.1%} | {s.ttft_p50:.2f} |", flush=True)


if __name__ == "__main__":
    main()
