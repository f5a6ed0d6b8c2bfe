"""The simulator experiments behind docs/SIMULATION.md, each mirroring one of the paper's figures.

Every function returns plain data; runs go through a two-process pool (the build machine has
two cores), each worker loading the trace and the profile once.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from halfmoon.cli.sim import DEFAULT_TRACE
from halfmoon.policy.state import SLO
from halfmoon.sim.config import SimConfig
from halfmoon.sim.profile import load_profile
from halfmoon.sim.replay import cache_hit_rate
from halfmoon.sim.run import max_sustainable_scale, simulate
from halfmoon.sim.trace import load_trace

TBT_SWEEP = (0.1, 0.2, 0.3, 0.5, 1.0)
NAMED = {"I": 0.1, "II": 0.2, "III": 0.3}
CAPACITIES = (1_000, 3_000, 5_859, 10_000, 30_000, 100_000, None)  # 5,859 blocks = 3M tokens, one node
EVICTIONS = ("lru", "lfu", "length-aware")
PREFILL_POLICIES = ("random", "load-balancing", "local-cache-aware", "global-cache-aware")
SPLITS = tuple((p, 16 - p) for p in range(5, 12))  # the range of the paper's Figure 15
_STATE: dict[str, Any] = {}


def _init() -> None:
    _STATE["trace"] = load_trace(DEFAULT_TRACE)
    _STATE["profile"] = load_profile()


def node_blocks() -> int:
    """Blocks one node's DRAM holds under the bundled profile (3M tokens / 512)."""
    return load_profile().dram_cache_tokens_per_node // 512


def _run(config: SimConfig) -> dict[str, Any]:
    result = simulate(config, _STATE["profile"], _STATE["trace"])
    out = result.outcomes
    return {
        "summary": result.summary._asdict(),
        "capacity": {str(thr): out.capacity(config.slo.ttft_s, thr) for thr in TBT_SWEEP},
        "capacity_at_slo": out.capacity(config.slo.ttft_s, config.slo.tbt_s),
        "pulled": result.pulled_blocks,
        "wasted_s": result.wasted_prefill_s,
        "replicas": [r._asdict() for r in result.replicas],
        "wall_s": result.wall_seconds,
        "pipelined": result.pipelined,
        "long": _long_prompts(out, config.slo.ttft_s),
    }


LONG_PROMPT = 100_000  # tokens; the trace's prompts from here on take one 8xA800 node over 27 s


def _long_prompts(out, ttft_s: float) -> dict[str, float]:
    """Outcome of the trace's longest prompts (the ones a single node cannot serve in time)."""
    lengths = np.array([r.input_length for r in _STATE["trace"]])
    long = lengths >= LONG_PROMPT
    ttft = out.ttft[long]
    served = ttft[~np.isnan(ttft)]
    return {
        "count": int(long.sum()),
        "within_slo": int((served <= ttft_s).sum()),
        "ttft_mean": float(served.mean()) if served.size else float("nan"),
        "ttft_max": float(served.max()) if served.size else float("nan"),
    }


def _scale(job: tuple[SimConfig, float]) -> float:
    config, tbt = job
    return max_sustainable_scale(config, _STATE["profile"], _STATE["trace"], tbt, low=0.25, high=8.0, steps=4)


def _hit(job: tuple[int | None, str]) -> float:
    return cache_hit_rate(_STATE["trace"], job[0], job[1])


class Runner:
    def __init__(self, workers: int = 2) -> None:
        self.pool = ProcessPoolExecutor(workers, initializer=_init)

    def runs(self, configs: list[SimConfig]) -> list[dict[str, Any]]:
        return list(self.pool.map(_run, configs))

    def scales(self, jobs: list[tuple[SimConfig, float]]) -> list[float]:
        return list(self.pool.map(_scale, jobs))

    def hits(self, jobs: list[tuple[int | None, str]]) -> list[float]:
        return list(self.pool.map(_hit, jobs))

    def close(self) -> None:
        self.pool.shutdown()


def halfmoon(prefill: int = 8, decode: int = 8, **kw: Any) -> SimConfig:
    return SimConfig(prefill_nodes=prefill, decode_nodes=decode, pool_blocks=prefill * node_blocks(), **kw)


def coupled(variant: str, nodes: int = 16) -> SimConfig:
    router = "local-cache-aware" if variant == "prefix" else "load-balancing"
    return SimConfig(mode="coupled", prefill_nodes=nodes, decode_nodes=0, coupled_variant=variant, coupled_router=router)


SYSTEMS = {
    "Halfmoon 8P+8D": halfmoon(),
    "coupled (vLLM)": coupled("plain"),
    "coupled + prefix cache": coupled("prefix"),
    "coupled + chunked prefill": coupled("chunked"),
}


def exp_a(r: Runner) -> dict[str, dict[str, Any]]:
    """Figure 5: average TTFT per prefill scheduling policy, 16 nodes (8P+8D)."""
    return dict(zip(PREFILL_POLICIES, r.runs([halfmoon(prefill_policy=p) for p in PREFILL_POLICIES])))


def exp_b(r: Runner) -> dict[str, Any]:
    """Figures 9-10: hit rate by eviction policy and capacity; global pool against local caches."""
    grid = [(cap, ev) for ev in EVICTIONS for cap in CAPACITIES]
    theory = r.hits(grid)
    sims = r.runs([dataclasses.replace(halfmoon(eviction=ev), pool_blocks=cap) for cap, ev in grid])
    scopes = r.runs([halfmoon(10, 6, prefill_policy=p) for p in ("local-cache-aware", "global-cache-aware")])
    return {
        "grid": grid,
        "theory": theory,
        "sim": sims,
        "local": scopes[0],
        "global": scopes[1],
    }


def exp_c(r: Runner) -> dict[str, Any]:
    """Figures 1 and 8: effective capacity against TBT threshold, prefill compute per request,
    and our stricter figure, the largest arrival scale keeping >= 90% effective."""
    runs = dict(zip(SYSTEMS, r.runs(list(SYSTEMS.values()))))
    jobs = [(dataclasses.replace(cfg, slo=SLO(30.0, thr)), thr) for cfg in SYSTEMS.values() for thr in NAMED.values()]
    flat = r.scales(jobs)
    scales = {name: dict(zip(NAMED, flat[i * 3:(i + 1) * 3])) for i, name in enumerate(SYSTEMS)}
    return {"runs": runs, "scales": scales}


def exp_d(r: Runner) -> dict[str, Any]:
    """Figure 15: effective capacity and latency as the P/D split of 16 nodes varies."""
    configs = [halfmoon(p, d) for p, d in SPLITS]
    runs = r.runs(configs)
    scales = r.scales([(cfg, 0.1) for cfg in configs])
    return {"splits": SPLITS, "runs": runs, "scales": scales}


def exp_e(r: Runner) -> dict[str, Any]:
    """arXiv Table 3: rejections under overload (2x speed, 8P+8D), by admission policy, at the
    issue's TBT SLO (100 ms) and at 25 ms, where this trace's decode pool is the bottleneck."""
    admissions = ("none", "early", "predictive")
    out = {}
    for tbt in (0.1, 0.025):
        configs = [halfmoon(admission=a, time_scale=2.0, slo=SLO(30.0, tbt)) for a in admissions]
        out[str(tbt)] = dict(zip(admissions, r.runs(configs)))
    return out
