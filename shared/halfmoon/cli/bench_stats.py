"""The figures of one `halfmoon bench` run, from its per-request results. Pure code.

Goodput counts a request when it succeeded, its TTFT is within the TTFT SLO and its mean time per
output token after the first (TPOT) is within the ITL SLO; failed requests count against it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from halfmoon.cli.bench_driver import RequestResult

QUANTILES = (50, 90, 99)


class SLO(NamedTuple):
    ttft_ms: float
    itl_ms: float


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for q in QUANTILES:
        p = percentile(values, q)
        out[f"p{q}"] = None if p is None else p * 1000
    out["mean"] = sum(values) / len(values) * 1000 if values else None
    return out


def meets(result: RequestResult, slo: SLO) -> bool:
    ttft, tpot = result.ttft_s, result.tpot_s
    return result.ok and ttft is not None and tpot is not None and (
        ttft * 1000 <= slo.ttft_ms and tpot * 1000 <= slo.itl_ms)


def outcome(result: RequestResult, slo: SLO) -> str:
    """``met`` or ``missed`` (served, within the SLOs or not), ``rejected`` (429: admission said no)
    or ``failed`` (anything else)."""
    if result.ok:
        return "met" if meets(result, slo) else "missed"
    return "rejected" if result.status == "429" else "failed"


def false_rejections(admitted: Sequence[str], unguarded: Sequence[str]) -> dict[str, int]:
    """Pair two runs of the same requests, one with admission control and one without (``outcome``
    per request, in request order): a request rejected in the first that met its SLOs in the second
    was rejected falsely."""
    if len(admitted) != len(unguarded):
        raise ValueError(f"runs differ in length: {len(admitted)} vs {len(unguarded)}")
    pairs = list(zip(admitted, unguarded))
    return {"rejected": sum(a == "rejected" for a, _ in pairs),
            "false": sum(a == "rejected" and u == "met" for a, u in pairs),
            "accepted_met": sum(a == "met" for a, _ in pairs),
            "accepted": sum(a in ("met", "missed") for a, _ in pairs)}


def summarise(results: Sequence[RequestResult], duration_s: float, slo: SLO) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    good = sum(meets(r, slo) for r in results)
    per_second = (lambda n: n / duration_s) if duration_s > 0 else (lambda _n: 0.0)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(sorted(Counter(r.status for r in results if not r.ok).items())),
        "duration_s": duration_s,
        "request_throughput": per_second(len(ok)),
        "output_throughput": per_second(out_tokens),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "cached_prompt_share": sum(cached) / prompt_tokens if cached and prompt_tokens else None,
        "ttft_ms": _ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": _ms([gap for r in ok for gap in r.itl_s]),
        "tpot_ms": _ms([r.tpot_s for r in ok if r.tpot_s is not None and r.output_tokens > 1]),
        "goodput": {"slo_ttft_ms": slo.ttft_ms, "slo_itl_ms": slo.itl_ms, "met": good,
                    "share": good / len(results) if results else None, "rate": per_second(good)},
        "outcomes": [outcome(r, slo) for r in results],
    }


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative bucket counts of one Prometheus histogram (every label set summed)."""

    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending, ending at +Inf

    @classmethod
    def from_samples(cls, samples: Iterable[tuple[float, float]]) -> Histogram:
        summed: dict[float, float] = {}
        for bound, count in samples:
            summed[bound] = summed.get(bound, 0.0) + count
        return cls(tuple(sorted(summed.items())))

    def minus(self, earlier: Histogram) -> Histogram:
        before = dict(earlier.buckets)
        return Histogram(tuple((b, c - before.get(b, 0.0)) for b, c in self.buckets))

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def quantile(self, q: float) -> float | None:
        """Prometheus's histogram_quantile: linear within the bucket; the last finite bound past it."""
        if self.count <= 0:
            return None
        target, lower, below = q * self.count, 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= target:
                if math.isinf(bound):
                    return lower
                inside = cumulative - below
                return lower + (bound - lower) * ((target - below) / inside if inside else 1.0)
            lower, below = bound, cumulative
        return lower
