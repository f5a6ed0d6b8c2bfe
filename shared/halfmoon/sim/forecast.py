"""The online planner's load forecast: what the next interval will bring, from what the past ones brought.

The predictor is Holt's double exponential smoothing (level + trend, "Holt's linear method"), one per
signal: it follows a ramp with the ramp's slope (simple smoothing lags a ramp by a constant), costs O(1)
per interval, and needs no fitting, so it starts forecasting from the second interval. The signals are
the ones a deployment already reports (docs/PLANNER.md): the arrival rate, the mean prompt and output
lengths and the share of prompt tokens reused from the KVCache pool. The per-request means are only
updated by intervals that saw requests: an idle interval says nothing about how long prompts are.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from halfmoon.sim.trace import TraceRequest


class ForecastError(ValueError):
    """A forecasting setting is out of range."""


class IntervalLoad(NamedTuple):
    """One interval's load: requests per second and, per request, the mean prompt and output tokens
    and the share of prompt tokens reused from the cache (0..1)."""

    arrival_rps: float
    prompt_tokens: float
    output_tokens: float
    reuse: float

    def scaled(self, factor: float) -> IntervalLoad:
        """The same requests, ``factor`` times as many per second."""
        return self._replace(arrival_rps=self.arrival_rps * factor)


class Holt:
    """Holt's double exponential smoothing of one series: ``alpha`` weighs the newest value in the level,
    ``beta`` the newest level change in the trend."""

    def __init__(self, alpha: float, beta: float) -> None:
        if not (0.0 < alpha <= 1.0 and 0.0 <= beta <= 1.0):
            raise ForecastError(f"Holt needs 0 < alpha <= 1 and 0 <= beta <= 1, got {alpha}, {beta}")
        self.alpha, self.beta = alpha, beta
        self.level: float | None = None
        self.trend = 0.0

    def update(self, value: float) -> None:
        if self.level is None:
            self.level = value
            return
        previous = self.level
        self.level = self.alpha * value + (1 - self.alpha) * (previous + self.trend)
        self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.trend

    def forecast(self, steps: int = 1) -> float | None:
        return None if self.level is None else self.level + steps * self.trend


@dataclass(frozen=True)
class Smoothing:
    """Holt's weights; the defaults follow a ramp within a few intervals (tests/planner/test_forecast.py)
    and damp a one-interval spike to about half."""

    alpha: float = 0.5
    beta: float = 0.3

    def __post_init__(self) -> None:
        Holt(self.alpha, self.beta)  # validates


class LoadForecaster:
    """Feed it each interval's load in order (``observe``); ``forecast`` is the next interval's."""

    def __init__(self, smoothing: Smoothing = Smoothing()) -> None:
        self.rate, self.prompt, self.output, self.reuse = (Holt(smoothing.alpha, smoothing.beta) for _ in range(4))

    def observe(self, load: IntervalLoad, requests: int) -> None:
        self.rate.update(load.arrival_rps)
        if requests:
            self.prompt.update(load.prompt_tokens)
            self.output.update(load.output_tokens)
            self.reuse.update(load.reuse)

    def forecast(self) -> IntervalLoad | None:
        """None until an interval with requests was observed; rates and lengths never fall below what
        can exist (0 requests/s, 1 token, reuse in [0, 1])."""
        rate, prompt, output, reuse = (h.forecast() for h in (self.rate, self.prompt, self.output, self.reuse))
        if rate is None or prompt is None or output is None or reuse is None:
            return None
        return IntervalLoad(max(0.0, rate), max(1.0, prompt), max(1.0, output), min(1.0, max(0.0, reuse)))


def trace_windows(trace: Sequence[TraceRequest], interval_s: float, block_size: int = 512) -> list[tuple[IntervalLoad, int]]:
    """The load of each ``interval_s`` window of a trace (Mooncake format: ``hash_ids`` of ``block_size``
    tokens) from its first arrival on, and its number of requests; reuse counts the leading blocks some
    earlier request had."""
    if interval_s <= 0:
        raise ForecastError(f"interval_s must be > 0, got {interval_s}")
    if not trace:
        return []
    seen: set[int] = set()
    start = trace[0].arrival_s
    count = math.floor((trace[-1].arrival_s - start) / interval_s) + 1
    sums = [[0, 0.0, 0.0, 0.0] for _ in range(count)]  # requests, prompt, output, reused tokens
    for r in trace:
        reused = 0
        for key in r.hash_ids:
            if key not in seen:
                break
            reused += 1
        seen.update(r.hash_ids)
        s = sums[math.floor((r.arrival_s - start) / interval_s)]
        s[0] += 1
        s[1] += r.input_length
        s[2] += r.output_length
        s[3] += min(r.input_length, reused * block_size)
    return [(IntervalLoad(n / interval_s, prompt / n, output / n, reused / prompt) if n else
             IntervalLoad(0.0, 0.0, 0.0, 0.0), int(n)) for n, prompt, output, reused in sums]


class ErrorReport(NamedTuple):
    """One-step-ahead errors of the arrival-rate forecast over a trace's windows, beside the naive
    forecast (the next interval is the last one) as the baseline any predictor must beat."""

    windows: int
    mean_rps: float
    mae_rps: float  # mean absolute error, requests/s
    naive_mae_rps: float
    prompt_mape: float  # mean absolute percentage error of the mean prompt length (windows with requests)


def forecast_error(trace: Sequence[TraceRequest], interval_s: float, smoothing: Smoothing = Smoothing(),
                   block_size: int = 512) -> ErrorReport:
    """Forecast each window from the ones before it; scored from the second window on."""
    windows = trace_windows(trace, interval_s, block_size)
    if len(windows) < 2:
        raise ForecastError(f"a trace needs two {interval_s:g} s windows to score a forecast; it has {len(windows)}")
    forecaster = LoadForecaster(smoothing)
    forecaster.observe(*windows[0])  # the first window (never empty) seeds the levels
    errors, naive, prompt_errors = [], [], []
    for (previous, _), (actual, requests) in itertools.pairwise(windows):
        predicted = forecaster.forecast()
        assert predicted is not None  # seeded above
        errors.append(abs(predicted.arrival_rps - actual.arrival_rps))
        naive.append(abs(previous.arrival_rps - actual.arrival_rps))
        if requests:
            prompt_errors.append(abs(predicted.prompt_tokens - actual.prompt_tokens) / actual.prompt_tokens)
        forecaster.observe(actual, requests)
    mean = sum(w.arrival_rps for w, _ in windows[1:]) / len(errors)
    return ErrorReport(len(errors), mean, sum(errors) / len(errors), sum(naive) / len(naive),
                       sum(prompt_errors) / len(prompt_errors) if prompt_errors else 0.0)
