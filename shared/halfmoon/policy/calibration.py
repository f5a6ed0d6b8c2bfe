"""Calibrating the predicted TTFT against the TTFTs delivered.

The cost model predicts a request's TTFT as queue wait plus its own prefill, request by request. An engine
does not run that way: prompts arriving within one step share the next one (the first of them gets its
token at the end of the shared step, not after its own prefill), an aggregated instance's steps also
carry its decoding requests, and the live path (NATS, the pool lookup, the step already running when a
request arrives) adds time no cost sample holds. What remains is systematic, so it is learned:
``delivered ~ intercept + slope * predicted`` over the recent first tokens.

The slope is Theil-Sen's (the median of pairwise slopes, robust to the few outliers a trace holds), fitted
only when the predictions span a factor of 2, and kept within [``min_slope``, ``max_slope``]; otherwise it
is 1 and only the median offset is learned. Beyond twice the largest prediction seen, the slope is 1: an
overload bigger than any measured is not extrapolated into rejections. Samples older than ``horizon_s``
are forgotten, so a calibration learned under one load cannot outlive it (rejected requests deliver no
samples, and would otherwise keep it).

Off by default (the conductor's ``ttft_calibration_s``): measured on two runs it did not make predictions
better or admission kinder (docs/BENCHMARKS.md, Predictions and admission).

Pure: no I/O and no clock (``now`` is any monotonic seconds, the same clock for both calls).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np


class TTFTSample(NamedTuple):
    at: float
    predicted_s: float
    delivered_s: float


class TTFTFit(NamedTuple):
    """``delivered = intercept + slope * predicted`` up to ``linear_up_to``, then one to one."""

    intercept: float = 0.0
    slope: float = 1.0
    linear_up_to: float = float("inf")

    def __call__(self, predicted_s: float) -> float:
        linear = min(predicted_s, self.linear_up_to)
        return max(0.0, self.intercept + self.slope * linear + (predicted_s - linear))


IDENTITY = TTFTFit()


class TTFTCalibration:
    """The recent first tokens' (predicted, delivered) TTFTs, and the fit that maps one to the other."""

    def __init__(self, horizon_s: float = 120.0, min_samples: int = 8, window: int = 256,
                 min_slope: float = 0.5, max_slope: float = 2.0) -> None:
        if horizon_s <= 0 or min_samples < 2 or window < min_samples or not 0 < min_slope <= 1 <= max_slope:
            raise ValueError("need horizon_s > 0, window >= min_samples >= 2 and 0 < min_slope <= 1 <= max_slope")
        self.horizon_s = horizon_s
        self.min_samples = min_samples
        self.min_slope, self.max_slope = min_slope, max_slope
        self._samples: deque[TTFTSample] = deque(maxlen=window)
        self._fit: TTFTFit | None = IDENTITY

    def record(self, predicted_s: float, delivered_s: float, now: float) -> None:
        """One request's first token: the TTFT the model predicted for it and the one delivered."""
        if not (np.isfinite(predicted_s) and np.isfinite(delivered_s)) or min(predicted_s, delivered_s) < 0:
            raise ValueError(f"bad TTFT sample {(predicted_s, delivered_s)}")
        self._samples.append(TTFTSample(now, predicted_s, delivered_s))
        self._fit = None

    def fit(self, now: float) -> TTFTFit:
        """The current fit (identity until ``min_samples`` recent samples)."""
        while self._samples and self._samples[0].at < now - self.horizon_s:
            self._samples.popleft()
            self._fit = None
        if self._fit is None:
            self._fit = self._refit()
        return self._fit

    def correct(self, predicted_s: float, now: float) -> float:
        """The TTFT to expect for a request the model predicts ``predicted_s`` for."""
        return self.fit(now)(predicted_s)

    def __len__(self) -> int:
        return len(self._samples)

    def _refit(self) -> TTFTFit:
        if len(self._samples) < self.min_samples:
            return IDENTITY
        x = np.fromiter((s.predicted_s for s in self._samples), dtype=np.float64)
        y = np.fromiter((s.delivered_s for s in self._samples), dtype=np.float64)
        slope = 1.0
        if x.max() > 0 and x.max() >= 2 * x.min():
            i, j = np.triu_indices(len(x), k=1)
            dx = x[j] - x[i]
            apart = dx > 1e-9 * x.max()
            slope = float(np.clip(np.median((y[j] - y[i])[apart] / dx[apart]), self.min_slope, self.max_slope))
        return TTFTFit(float(np.median(y - slope * x)), slope, 2 * float(x.max()))
