"""Cost models the Conductor predicts with: prefill time, decode step time, KV transfer time.

Prefill follows the paper's Equation 1: computing tokens ``p..n`` of a prompt whose first ``p``
are cached costs ``l*(a*(n^2 - p^2)*d + b*(n - p)*d^2)`` FLOPs. With ``x = n - p`` new tokens,
``n^2 - p^2 = x^2 + 2*x*p``, so time is a polynomial in (new, cached) with the features
``[1, x, x^2, x*p]``; the coefficients are fitted by non-negative least squares from measurements.
Decode is memory-bound: a step reads the weights once and every running request's KV, so its
time is linear in (batch size, total context) with the features ``[1, b, C]``.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np


class CostModelError(ValueError):
    """A cost model got unusable input (too few samples, negative sizes, non-finite values)."""


def prefill_features(new_tokens: float, cached_tokens: float) -> tuple[float, ...]:
    return (1.0, new_tokens, new_tokens * new_tokens, new_tokens * cached_tokens)


def decode_features(batch_size: float, context_tokens: float) -> tuple[float, ...]:
    return (1.0, batch_size, context_tokens)


def _nonnegative_lstsq(rows: Sequence[tuple[float, ...]], targets: Sequence[float]) -> tuple[float, ...]:
    """Least squares with every coefficient at least 0: time never shrinks as work grows.

    Unconstrained, samples whose time barely varies (a tiny model's decode steps, 12-18 ms at
    any batch) fitted a negative slope nine times in ten, and the busier of two instances then
    looked the cheaper one and drew every request. With 3 or 4 features the exact answer is
    cheap: the best of the unconstrained fits on each subset of features that come out
    non-negative.
    """
    a = np.asarray(rows, dtype=np.float64)
    y = np.asarray(targets, dtype=np.float64)
    if a.ndim != 2 or len(a) < a.shape[1]:
        raise CostModelError(f"need at least {a.shape[-1]} samples to fit, got {len(a)}")
    if not (np.isfinite(a).all() and np.isfinite(y).all()):
        raise CostModelError("samples must be finite")
    width = a.shape[1]
    best, best_residual = np.zeros(width), float(y @ y)
    for support in itertools.chain.from_iterable(itertools.combinations(range(width), k) for k in range(1, width + 1)):
        cols = list(support)
        coef, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if (coef < 0).any():
            continue
        residual = y - a[:, cols] @ coef
        if (r := float(residual @ residual)) < best_residual:
            best, best_residual = np.zeros(width), r
            best[cols] = coef
    return tuple(float(c) for c in best)


def _fit(samples: Iterable[tuple[float, float, float]], features: Callable[[float, float], tuple[float, ...]],
         what: str) -> tuple[float, ...]:
    """Least-squares coefficients from ``(x, y, seconds)`` measurements of one cost model."""
    rows, ys = [], []
    for x, y, seconds in samples:
        if x < 0 or y < 0 or seconds < 0:
            raise CostModelError(f"negative {what} sample {(x, y, seconds)}")
        rows.append(features(x, y))
        ys.append(seconds)
    return _nonnegative_lstsq(rows, ys)


class PrefillCostModel(NamedTuple):
    """Seconds to prefill ``new`` tokens on top of ``cached`` reused ones (features ``[1, x, x^2, x*p]``)."""

    coef: tuple[float, float, float, float]

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float, float]]) -> PrefillCostModel:
        """Fit from ``(new_tokens, cached_tokens, seconds)`` measurements."""
        c0, c1, c2, c3 = _fit(samples, prefill_features, "prefill")
        return cls((c0, c1, c2, c3))

    def predict(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        if new_tokens <= 0:
            return 0.0
        c0, c1, c2, c3 = self.coef
        return max(0.0, c0 + new_tokens * (c1 + c2 * new_tokens + c3 * cached_tokens))

    def scaled(self, factor: float) -> PrefillCostModel:
        """The same shape, every prediction times ``factor``."""
        c0, c1, c2, c3 = self.coef
        return PrefillCostModel((c0 * factor, c1 * factor, c2 * factor, c3 * factor))


class DecodeCostModel(NamedTuple):
    """Seconds per decode iteration for a batch of ``b`` requests holding ``C`` context tokens."""

    coef: tuple[float, float, float]

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float, float]]) -> DecodeCostModel:
        """Fit from ``(batch_size, context_tokens, seconds)`` measurements."""
        c0, c1, c2 = _fit(samples, decode_features, "decode")
        return cls((c0, c1, c2))

    def predict(self, batch_size: float, context_tokens: float) -> float:
        if batch_size <= 0:
            return 0.0
        c0, c1, c2 = self.coef
        return max(0.0, c0 + c1 * batch_size + c2 * context_tokens)

    def scaled(self, factor: float) -> DecodeCostModel:
        """The same shape, every prediction times ``factor``."""
        c0, c1, c2 = self.coef
        return DecodeCostModel((c0 * factor, c1 * factor, c2 * factor))

    @property
    def per_context_token(self) -> float:
        """Growth of the step time per extra context token (the batch adds ``b`` tokens per step)."""
        return max(0.0, self.coef[2])


class TransferModel(NamedTuple):
    """Time to pull KV blocks between nodes: a per-batch latency plus bytes over bandwidth."""

    bytes_per_token: float
    bandwidth_bytes_per_s: float
    latency_s: float

    def seconds(self, tokens: float) -> float:
        if tokens <= 0:
            return 0.0
        return self.latency_s + tokens * self.bytes_per_token / self.bandwidth_bytes_per_s


class CostModels(NamedTuple):
    prefill: PrefillCostModel
    decode: DecodeCostModel
    transfer: TransferModel


def weighted_median(values: np.ndarray, weights: np.ndarray, lower: bool = False) -> float:
    """The value where the cumulative weight reaches half (between two values when it lands on one
    exactly, as ``np.median`` does for equal weights; ``lower``: the lower of the two)."""
    order = np.argsort(values)
    values, cumulative = values[order], np.cumsum(weights[order])
    half = cumulative[-1] / 2
    i = int(np.searchsorted(cumulative, half))
    if np.isclose(cumulative[i], half) and i + 1 < len(values) and not lower:
        return float((values[i] + values[i + 1]) / 2)
    return float(values[i])


class OnlineFitter:
    """Refits a model from the latest measurements a live instance reports.

    ``record`` keeps the last ``window`` samples; ``predict`` uses the prior model, rescaled to the
    measurements (by the median ratio of measured to prior-predicted time, each sample weighted by
    its prior-predicted time) from ``min_scale_samples`` on, until a least-squares fit takes over
    (from ``min_samples``, refreshed every ``refit_every`` records). A refit that fails keeps the
    previous model. The fit only covers what was measured: samples whose first variable (prompt
    tokens, batch size) takes fewer than ``min_distinct`` values or spans less than a factor of 2 do
    not replace the model (a polynomial fitted on prompts of 23 to 25 tokens predicted a minute for
    85), and beyond twice the largest measured value the prediction grows from the fit's value there as the
    rescaled prior grows (never falling as the batch or prompt grows). The rescaling is
    what makes a prior guessed for another machine (8,000 prompt tokens/s where a CPU does 400)
    right in speed even when every prompt has one length.
    The weights keep short prompts, whose time is mostly fixed overhead, from setting the speed of
    long ones: unweighted, four 20-token prompts at 1.4x the prior and two 400-token ones at 0.4x
    predicted a 2,000-token prompt 2.3x slower than it ran, and a burst was rejected whole.
    """

    def __init__(
        self,
        fit: Callable[[Iterable[tuple[float, float, float]]], PrefillCostModel | DecodeCostModel],
        prior: PrefillCostModel | DecodeCostModel,
        *,
        window: int = 512,
        min_samples: int = 16,
        refit_every: int = 8,
        min_distinct: int = 4,
        min_scale_samples: int = 3,
    ) -> None:
        if window < min_samples or min_samples < 1 or refit_every < 1 or min(min_distinct, min_scale_samples) < 1:
            raise CostModelError("need window >= min_samples >= 1, and refit_every, min_distinct and "
                                 "min_scale_samples >= 1")
        self._fit = fit
        self.prior = prior
        self.scaled_prior = prior
        self._min_scale = min_scale_samples
        self._min_distinct = min_distinct
        self._fitted_up_to: float | None = None  # the largest first variable the current fit saw
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._min = min_samples
        self._every = refit_every
        self._since_fit = 0
        self.model = prior

    def record(self, a: float, b: float, seconds: float) -> None:
        """Add one measurement: (new, cached, s) for prefill or (batch, context, s) for decode."""
        if not all(np.isfinite((a, b, seconds))) or min(a, b, seconds) < 0:
            raise CostModelError(f"bad sample {(a, b, seconds)}")
        self._samples.append((a, b, seconds))
        self._since_fit += 1
        self._rescale_prior()
        if len(self._samples) >= self._min and self._since_fit >= self._every:
            self._since_fit = 0
            firsts = {sample[0] for sample in self._samples}
            if len(firsts) < self._min_distinct or max(firsts) < 2 * max(min(firsts), 1.0):
                return
            try:
                self.model = self._fit(self._samples)
            except CostModelError:
                return
            self._fitted_up_to = max(firsts)

    def _rescale_prior(self) -> None:
        predicted = np.array([self.prior.predict(x, y) for x, y, _ in self._samples])
        measured = np.array([s for _, _, s in self._samples])
        usable = predicted > 0
        if usable.sum() < self._min_scale:
            return
        ratio = weighted_median(measured[usable] / predicted[usable], predicted[usable])
        self.scaled_prior = self.prior.scaled(ratio)
        if self._fitted_up_to is None:
            self.model = self.scaled_prior

    def predict(self, a: float, b: float) -> float:
        edge = None if self._fitted_up_to is None else 2 * self._fitted_up_to
        if edge is not None and a > edge:
            # NOTE: from the fit's value at the edge: answered by the prior alone, a decoding step of 17
            # sequences past a fit of up to 8 came out a seventh of the fit's step of 16
            growth = self.scaled_prior.predict(a, b) - self.scaled_prior.predict(edge, b)
            return self.model.predict(edge, b) + max(0.0, growth)
        return self.model.predict(a, b)

    def __len__(self) -> int:
        return len(self._samples)
