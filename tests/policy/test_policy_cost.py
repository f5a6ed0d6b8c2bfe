import numpy as np
import pytest
from halfmoon.policy.cost import CostModelError, DecodeCostModel, OnlineFitter, PrefillCostModel, TransferModel


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


class TestOnlineFitter:
    def test_uses_prior_then_measurements(self):
        prior = DecodeCostModel((1.0, 0.0, 0.0))
        fitter = OnlineFitter(DecodeCostModel.fit, prior, window=64, min_samples=8, refit_every=4)
        assert fitter.predict(4, 1000) == 1.0
        for b in range(1, 9):
            fitter.record(b, 1000 * b, 0.01 + 0.001 * b)
        assert fitter.predict(4, 4000) == pytest.approx(0.014)
        assert len(fitter) == 8

    def test_rejects_bad_sample_and_fits_a_degenerate_window(self):
        fitter = OnlineFitter(PrefillCostModel.fit, PrefillCostModel((0.0, 1e-3, 0.0, 0.0)), min_samples=4, refit_every=1)
        with pytest.raises(CostModelError):
            fitter.record(float("nan"), 0, 1.0)
        for _ in range(5):  # identical samples: rank-deficient but lstsq still returns a least-norm fit
            fitter.record(100, 0, 0.1)
        assert fitter.predict(100, 0) == pytest.approx(0.1)
