import itertools

import numpy as np
import pytest

from halfmoon.policy.cost import (
    CostModelError,
    DecodeCostModel,
    OnlineFitter,
    PrefillCostModel,
    TransferModel,
    weighted_median,
)


class TestPrefillFit:
    def test_recovers_equation_one_coefficients(self):
        truth = PrefillCostModel((0.02, 2e-4, 3e-9, 6e-9))
        rng = np.random.default_rng(0)
        samples = [(x, p, truth.predict(x, p)) for x, p in rng.integers(1, 60_000, size=(50, 2))]
        fitted = PrefillCostModel.fit(samples)
        assert fitted.coef == pytest.approx(truth.coef, rel=1e-6, abs=1e-12)
        # caching a prefix makes the remaining tokens dearer per token (they attend to it) but the whole cheaper
        assert fitted.predict(1000, 9000) < fitted.predict(10_000, 0)

    def test_too_few_or_bad_samples_raise(self):
        with pytest.raises(CostModelError):
            PrefillCostModel.fit([(1, 0, 0.1)])
        with pytest.raises(CostModelError):
            DecodeCostModel.fit([(1, -5, 0.1)] * 5)


class TestDecodeAndTransfer:
    def test_decode_linear_in_batch_and_context(self):
        model = DecodeCostModel.fit([(b, c, 0.01 + 1e-4 * b + 3e-8 * c) for b in (1, 8, 32) for c in (1e3, 1e5, 1e6)])
        assert model.predict(16, 500_000) == pytest.approx(0.01 + 16e-4 + 0.015)
        assert model.predict(0, 100) == 0.0

    def test_transfer_seconds(self):
        t = TransferModel(bytes_per_token=320 * 1024, bandwidth_bytes_per_s=87e9, latency_s=0.001)
        assert t.seconds(0) == 0.0
        assert t.seconds(8192) == pytest.approx(0.001 + 8192 * 320 * 1024 / 87e9)


class TestNonNegativeFit:
    """Time never shrinks as work grows: a fit on flat, noisy samples has no negative slope."""

    def test_flat_noisy_decode_steps_fit_no_negative_slope(self):
        rng = np.random.default_rng(1)
        batches = rng.choice([1, 2, 3, 4], size=40)
        samples = [(b, b * rng.uniform(20, 60), rng.uniform(0.012, 0.018)) for b in batches]
        unconstrained, *_ = np.linalg.lstsq(np.array([(1, b, c) for b, c, _ in samples]),
                                            np.array([s for *_, s in samples]), rcond=None)
        assert (unconstrained[1:] < 0).any()  # the samples are ones that misled the plain fit
        model = DecodeCostModel.fit(samples)
        assert min(model.coef) >= 0
        assert model.predict(4, 240) >= model.predict(1, 20)
        assert model.predict(2, 80) == pytest.approx(0.015, abs=0.002)

    def test_the_constrained_fit_is_the_best_non_negative_one(self):
        rng = np.random.default_rng(2)
        samples = [(x, p, max(0.0, 0.05 - 1e-5 * x + rng.normal(0, 1e-3))) for x, p in rng.integers(1, 2000, (30, 2))]
        model = PrefillCostModel.fit(samples)
        assert min(model.coef) >= 0

        def residual(coef):
            return sum((PrefillCostModel(coef).predict(x, p) - s) ** 2 for x, p, s in samples)

        for nudged in ((model.coef[0] * 1.01, *model.coef[1:]), (model.coef[0] * 0.99, *model.coef[1:]),
                       (model.coef[0], model.coef[1] + 1e-6, *model.coef[2:])):
            assert residual(model.coef) <= residual(nudged)


class TestOnlineFitter:
    def test_one_prompt_length_still_corrects_the_prior_speed(self):
        """As measured live: a fixed-length benchmark (512-token prompts) on a CPU prefilling 400
        tokens/s under a prior of 8,000: predictions were 20x too low for the whole run."""
        prior = PrefillCostModel((0.0, 1 / 8000, 0.0, 0.0))
        fitter = OnlineFitter(PrefillCostModel.fit, prior)
        for seconds in (1.25, 1.3, 1.2, 1.4, 1.28):
            fitter.record(512, 0, seconds)
        assert fitter.predict(512, 0) == pytest.approx(1.28)
        assert fitter.predict(1024, 0) == pytest.approx(2.56)

    def test_short_prompts_overhead_does_not_slow_long_prompts(self):
        """As measured live (tiny model, AVX2 CPU, prior 1,000 tokens/s): four 20-token prompts on a
        cached prefix cost mostly fixed overhead; the two long prompts say how fast tokens go. A
        2,000-token prompt then took 1.12 s; the unweighted median ratio predicted 2.56 s."""
        prior = PrefillCostModel((0.0, 1e-3, 0.0, 0.0))
        fitter = OnlineFitter(PrefillCostModel.fit, prior)
        for sample in ((410, 0, 0.162), (20, 400, 0.025), (21, 400, 0.033), (22, 400, 0.033), (23, 400, 0.030),
                       (300, 0, 0.138)):
            fitter.record(*sample)
        assert fitter.predict(2000, 0) == pytest.approx(2000 * 0.162 / 410)  # the longest prompt's speed
        assert 0.6 < fitter.predict(2000, 0) / 1.12 < 1.0

    def test_weighted_median_of_equal_weights_is_the_median(self):
        rng = np.random.default_rng(1)
        for size in (1, 2, 5, 8):
            values = rng.random(size)
            assert weighted_median(values, np.ones(size)) == pytest.approx(float(np.median(values)))
        assert weighted_median(np.array([1.0, 2.0, 9.0]), np.array([1.0, 1.0, 5.0])) == 9.0
        assert weighted_median(np.array([20.0, 0.007]), np.ones(2)) == pytest.approx(10.0035)
        assert weighted_median(np.array([20.0, 0.007]), np.ones(2), lower=True) == 0.007

    def test_uses_prior_then_measurements(self):
        prior = DecodeCostModel((1.0, 0.0, 0.0))
        fitter = OnlineFitter(DecodeCostModel.fit, prior, window=64, min_samples=8, refit_every=4)
        assert fitter.predict(4, 1000) == 1.0
        for b in range(1, 9):
            fitter.record(b, 1000 * b, 0.01 + 0.001 * b)
        assert fitter.predict(4, 4000) == pytest.approx(0.014)
        assert len(fitter) == 8

    def test_rejects_bad_sample_and_rescales_the_prior_for_a_degenerate_window(self):
        prior = PrefillCostModel((0.0, 1e-3, 0.0, 0.0))
        fitter = OnlineFitter(PrefillCostModel.fit, prior, min_samples=4, refit_every=1)
        with pytest.raises(CostModelError):
            fitter.record(float("nan"), 0, 1.0)
        fitter.record(100, 0, 0.5)
        assert fitter.predict(200, 0) == pytest.approx(0.2)  # one sample is not enough to rescale
        for _ in range(4):  # identical samples say nothing about how time grows with the prompt, but
            fitter.record(100, 0, 0.5)  # they do say this machine is 5x slower than the prior
        assert fitter.model == prior.scaled(5.0) and fitter.predict(200, 0) == pytest.approx(1.0)

    def test_a_narrow_window_never_extrapolates_a_wild_curve(self):
        # as measured live: one prompt length (23-25 tokens) with scheduling noise; a quadratic through
        # these has any curvature, and at 85 tokens it predicted 64 s
        prior = PrefillCostModel((0.0, 1e-3, 0.0, 0.0))
        fitter = OnlineFitter(PrefillCostModel.fit, prior, min_samples=8, refit_every=1)
        for i in range(40):
            fitter.record(23 + i % 3, 0, (0.009, 0.059, 0.022)[i % 3])
        # the prior's shape, at the median measured speed (22 ms for 25 tokens: 0.88x the prior)
        assert fitter.predict(85, 0) == pytest.approx(0.085 * 0.022 / 0.025)

    def test_a_wide_window_is_fitted_and_used_within_twice_its_range(self):
        prior = PrefillCostModel((1.0, 0.0, 0.0, 0.0))
        fitter = OnlineFitter(PrefillCostModel.fit, prior, min_samples=8, refit_every=1)
        for x in (16, 32, 64, 128, 256, 16, 32, 64, 128, 256):
            fitter.record(x, 0, 0.001 + 1e-4 * x)
        assert fitter.predict(500, 0) == pytest.approx(0.001 + 0.05)  # fitted: within 2 x 256
        # beyond what was measured: the fit's value at twice the range, growing as the prior does (a constant)
        assert fitter.predict(600, 0) == pytest.approx(0.001 + 1e-4 * 512)

    def test_a_prediction_never_falls_past_the_fitted_range(self):
        """As measured live: a fit of decoding steps of up to 8 sequences, with a prior whose level the
        measurements set far lower; a step of 17 was predicted from the prior alone at a seventh of the
        fit's step of 16, and a burst placed on it saw gaps 25x its prediction."""
        prior = DecodeCostModel((0.002, 0.0005, 0.0))
        fitter = OnlineFitter(DecodeCostModel.fit, prior, min_samples=8, refit_every=1)
        for batch in (1, 2, 4, 8, 1, 2, 4, 8):
            fitter.record(batch, 0, 0.01 * batch if batch > 1 else 0.003)
        steps = [fitter.predict(batch, 0) for batch in range(1, 40)]
        assert all(later >= earlier for earlier, later in itertools.pairwise(steps))
        assert fitter.predict(17, 0) >= fitter.predict(16, 0) > 0.1
