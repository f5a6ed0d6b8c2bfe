"""Scheduling decision latency: 64 prefill + 64 decode instances, 128-block prompts.

Run: python -m benchmarks.sched_latency [--decisions N]
Times ``KVCentricScheduler.schedule`` (snapshots prepared beforehand, as the live conductor
keeps them) for each prefill policy with prediction-based admission; the random policy is
the in-run baseline the others are compared with.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from halfmoon.policy.admission import PredictiveEarlyRejection
from halfmoon.policy.decode import SloAwareDecode
from halfmoon.policy.prefill import PREFILL_POLICIES, make_prefill_policy
from halfmoon.policy.scheduler import KVCentricScheduler
from halfmoon.policy.state import SLO, DecodeInstanceState, DecodeWork, PrefillInstanceState, RouteRequest
from halfmoon.sim.profile import load_profile

PREFILL, DECODE, BLOCKS, BLOCK_SIZE = 64, 64, 128, 512


def build_cluster(seed: int = 0):
    """A warm cluster: 400 cached prefix chains of 128 blocks, each held up to some depth by 1-4 instances."""
    rng = random.Random(seed)
    chains = [tuple(f"c{c}b{b}" for b in range(BLOCKS)) for c in range(400)]
    index: dict[str, set[str]] = {}
    for chain in chains:
        for holder in rng.sample(range(PREFILL), rng.randint(1, 4)):
            for key in chain[: rng.randint(1, BLOCKS)]:
                index.setdefault(key, set()).add(f"p{holder}")
    prefill = [PrefillInstanceState(f"p{i}", rng.uniform(0, 5), rng.randint(0, 100_000)) for i in range(PREFILL)]
    decode = []
    for i in range(DECODE):
        work = tuple(DecodeWork(rng.randint(1_000, 30_000), -rng.uniform(0, 10), rng.uniform(0, 20)) for _ in range(24))
        decode.append(DecodeInstanceState(f"d{i}", len(work), sum(w.context_tokens for w in work), 1_220_000, (), work))
    requests = []
    for _ in range(256):
        chain = rng.choice(chains)
        shared = rng.randint(0, BLOCKS)
        keys = chain[:shared] + tuple(f"new{rng.random()}" for _ in range(BLOCKS - shared))
        requests.append(RouteRequest(keys, BLOCKS * BLOCK_SIZE, BLOCK_SIZE))
    return index, prefill, decode, requests


def measure(decisions: int = 2000) -> dict[str, tuple[float, float]]:
    """Policy name -> (p50 ms, p99 ms) per scheduling decision."""
    cost = load_profile().cost
    slo = SLO(ttft_s=30.0, tbt_s=0.1)
    index, prefill, decode, requests = build_cluster()
    out = {}
    for name in PREFILL_POLICIES:
        sched = KVCentricScheduler(make_prefill_policy(name, cost, slo), PredictiveEarlyRejection(SloAwareDecode(cost.decode, slo)), slo)
        for req in requests:  # warm-up: first-call and allocator effects stay out of the samples
            sched.schedule(req, prefill, decode, index, 0.0)
        samples = np.empty(decisions)
        for i in range(decisions):
            req = requests[i % len(requests)]
            t0 = time.perf_counter()
            sched.schedule(req, prefill, decode, index, 0.0)
            samples[i] = time.perf_counter() - t0
        out[name] = (float(np.percentile(samples, 50) * 1e3), float(np.percentile(samples, 99) * 1e3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=2000)
    args = parser.parse_args()
    results = measure(args.decisions)
    base = results["random"][0]
    print(f"scheduling decision latency, {PREFILL} prefill + {DECODE} decode instances, {BLOCKS}-block prompts")
    for name, (p50, p99) in results.items():
        print(f"  {name:20s} p50 {p50:7.3f} ms  p99 {p99:7.3f} ms  ({p50 / base:4.1f}x random p50)")


if __name__ == "__main__":
    main()
