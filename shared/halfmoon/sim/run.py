"""Entry points: one simulation, and the search for the largest sustainable arrival-rate scale."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from halfmoon.sim.config import SimConfig
from halfmoon.sim.coupled import CoupledSim
from halfmoon.sim.disagg import DisaggregatedSim
from halfmoon.sim.engine import Progress, SimResult
from halfmoon.sim.mixed import MixedSim
from halfmoon.sim.profile import Profile
from halfmoon.sim.trace import TraceRequest


def simulate(config: SimConfig, profile: Profile, trace: Sequence[TraceRequest], progress: Progress | None = None) -> SimResult:
    cls = {"disaggregated": DisaggregatedSim, "coupled": CoupledSim, "mixed": MixedSim}[config.mode]
    return cls(config, profile, trace).run(progress)


def max_sustainable_scale(
    config: SimConfig,
    profile: Profile,
    trace: Sequence[TraceRequest],
    tbt_s: float,
    *,
    target: float = 0.9,
    low: float = 0.25,
    high: float = 4.0,
    steps: int = 5,
    on_run: Callable[[float, float], None] | None = None,
) -> float:
    """Largest ``time_scale`` in [low, high] whose effective capacity stays >= ``target``
    (bisection on a log scale, ``steps`` runs after the two bounds); 0.0 if even ``low`` fails."""

    def ok(scale: float) -> bool:
        result = simulate(dataclasses.replace(config, time_scale=scale), profile, trace)
        share = result.outcomes.capacity(config.slo.ttft_s, tbt_s)
        if on_run is not None:
            on_run(scale, share)
        return share >= target

    if not ok(low):
        return 0.0
    if ok(high):
        return high
    for _ in range(steps):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low
