"""Per-request outcomes and the paper's metrics over them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

OK, REJECTED_EARLY, REJECTED_LATE = 0, 1, 2
THRESHOLDS_S = {"I": 0.1, "II": 0.2, "III": 0.3}


def slowest_decile_mean(values: Sequence[float], counts: Sequence[int], first_gap: float = 0.0) -> float:
    """Mean of the slowest 10% of token intervals (the paper's TBT), from (interval, repeats) runs.

    ``first_gap`` lengthens the first interval (waiting between the previous token and the
    first step). With no intervals the TBT is 0.
    """
    n = sum(counts)
    if n == 0:
        return 0.0
    runs = [(values[0] + first_gap, 1)]
    if counts[0] > 1:
        runs.append((values[0], counts[0] - 1))
    runs.extend(zip(values[1:], counts[1:]))
    runs.sort(reverse=True)
    want = max(1, math.ceil(n / 10))
    total = 0.0
    left = want
    for value, count in runs:
        take = min(count, left)
        total += value * take
        left -= take
        if not left:
            break
    return total / want


class Outcomes:
    """Column arrays, one row per trace request; NaN marks 'never happened'."""

    def __init__(self, n: int) -> None:
        self.arrival = np.zeros(n)
        self.ttft = np.full(n, np.nan)
        self.tbt = np.full(n, np.nan)
        self.finished = np.full(n, np.nan)
        self.status = np.zeros(n, dtype=np.int8)
        self.prefill_s = np.zeros(n)
        self.hit_blocks = np.zeros(n, dtype=np.int64)
        self.blocks = np.zeros(n, dtype=np.int64)
        self.waited = np.zeros(n)  # seconds turned away as overloaded before placed or rejected

    def __len__(self) -> int:
        return len(self.arrival)

    def effective(self, ttft_s: float, tbt_s: float) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return (self.status == OK) & (self.ttft <= ttft_s) & (self.tbt <= tbt_s)

    def capacity(self, ttft_s: float, tbt_s: float) -> float:
        """Effective request capacity (paper 5.2.2): share of all requests meeting both SLOs."""
        return float(self.effective(ttft_s, tbt_s).mean()) if len(self) else 0.0


class Summary(NamedTuple):
    requests: int
    completed: int
    rejected_early: int
    rejected_late: int
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tbt_mean: float
    tbt_p50: float
    tbt_p90: float
    tbt_p99: float
    hit_rate: float
    prefill_s_mean: float
    capacity: dict[str, float]
    waited: int = 0  # requests that waited out an overload at least once


def _pct(a: np.ndarray, q: float) -> float:
    a = a[~np.isnan(a)]
    return float(np.percentile(a, q)) if len(a) else float("nan")


def summarize(out: Outcomes, ttft_slo_s: float = 30.0) -> Summary:
    prefilled = out.status != REJECTED_EARLY
    blocks = out.blocks[prefilled].sum()
    ttft, tbt = out.ttft, out.tbt
    return Summary(
        requests=len(out),
        completed=int((out.status == OK).sum()),
        rejected_early=int((out.status == REJECTED_EARLY).sum()),
        rejected_late=int((out.status == REJECTED_LATE).sum()),
        ttft_mean=float(np.nanmean(ttft)) if (~np.isnan(ttft)).any() else float("nan"),
        ttft_p50=_pct(ttft, 50), ttft_p90=_pct(ttft, 90), ttft_p99=_pct(ttft, 99),
        tbt_mean=float(np.nanmean(tbt)) if (~np.isnan(tbt)).any() else float("nan"),
        tbt_p50=_pct(tbt, 50), tbt_p90=_pct(tbt, 90), tbt_p99=_pct(tbt, 99),
        hit_rate=float(out.hit_blocks[prefilled].sum() / blocks) if blocks else 0.0,
        prefill_s_mean=float(out.prefill_s[prefilled].mean()) if prefilled.any() else 0.0,
        capacity={name: out.capacity(ttft_slo_s, thr) for name, thr in THRESHOLDS_S.items()},
        waited=int((out.waited > 0).sum()),
    )
