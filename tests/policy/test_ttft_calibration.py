"""The predicted TTFT, calibrated to the TTFTs delivered lately: what it learns, and what it will not."""

from __future__ import annotations

import pytest

from halfmoon.policy.admission import NoAdmission
from halfmoon.policy.calibration import TTFTCalibration
from halfmoon.policy.decode import SloAwareDecode
from halfmoon.policy.prefill import LocalCacheAwarePrefill
from halfmoon.policy.scheduler import KVCentricScheduler
from halfmoon.policy.state import SLO, DecodeInstanceState, PrefillInstanceState, RouteRequest


def learned(pairs: list[tuple[float, float]], at: float = 0.0, **kwargs: float) -> TTFTCalibration:
    calibration = TTFTCalibration(**kwargs)  # type: ignore[arg-type]
    for predicted, delivered in pairs:
        calibration.record(predicted, delivered, at)
    return calibration


class TestFit:
    def test_identity_until_enough_samples(self) -> None:
        calibration = learned([(1.0, 3.0)] * 7)
        assert calibration.correct(1.0, now=0.0) == 1.0
        calibration.record(1.0, 3.0, 0.0)
        assert calibration.correct(1.0, now=0.0) == pytest.approx(3.0)

    def test_predictions_of_one_size_learn_an_offset(self) -> None:
        calibration = learned([(1.0, 1.3)] * 10)
        assert calibration.correct(1.0, now=0.0) == pytest.approx(1.3)
        assert calibration.correct(1.5, now=0.0) == pytest.approx(1.8)  # slope 1: nothing to tell it by

    def test_spread_predictions_learn_slope_and_intercept(self) -> None:
        calibration = learned([(p, 0.2 + 1.5 * p) for p in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.7, 2.5)])
        fit = calibration.fit(now=0.0)
        assert (fit.intercept, fit.slope) == (pytest.approx(0.2), pytest.approx(1.5))
        assert calibration.correct(2.0, now=0.0) == pytest.approx(3.2)

    def test_beyond_twice_the_largest_seen_it_does_not_extrapolate_the_slope(self) -> None:
        calibration = learned([(p, 0.2 + 1.5 * p) for p in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.7, 2.5)])
        # 0.2 + 1.5 x 8 at the edge, then one to one
        assert calibration.correct(10.0, now=0.0) == pytest.approx(0.2 + 1.5 * 8 + 2)

    def test_one_outlier_does_not_move_it(self) -> None:
        pairs = [(p, 0.1 + p) for p in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.7, 2.5, 1.2, 3.5)]
        calibration = learned([*pairs, (1.0, 60.0)])
        assert calibration.correct(2.0, now=0.0) == pytest.approx(2.1, abs=0.05)

    def test_slope_is_bounded(self) -> None:
        calibration = learned([(p, 5 * p) for p in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.7, 2.5)])
        assert calibration.fit(now=0.0).slope == 2.0

    def test_old_samples_are_forgotten(self) -> None:
        calibration = learned([(1.0, 20.0)] * 10, at=0.0, horizon_s=60.0)
        assert calibration.correct(1.0, now=59.0) == pytest.approx(20.0)
        assert calibration.correct(1.0, now=61.0) == 1.0
        assert len(calibration) == 0

    def test_never_negative(self) -> None:
        calibration = learned([(2.0, 0.5)] * 10)
        assert calibration.correct(1.0, now=0.0) == 0.0

    @pytest.mark.parametrize(("predicted", "delivered"), [(-1.0, 1.0), (1.0, float("nan")), (float("inf"), 1.0)])
    def test_bad_samples_are_refused(self, predicted: float, delivered: float) -> None:
        with pytest.raises(ValueError):
            TTFTCalibration().record(predicted, delivered, 0.0)

    def test_bad_settings_are_refused(self) -> None:
        with pytest.raises(ValueError):
            TTFTCalibration(min_slope=1.5)


class TestSchedulerUsesIt:
    """1,000 new tokens at 1 ms each: the model predicts 1 s; the SLO is 30 s."""

    REQUEST = RouteRequest(tuple(f"k{i}" for i in range(10)), 1000, 100)
    SLO = SLO(ttft_s=30.0, tbt_s=0.05)

    def schedule(self, cost, calibration: TTFTCalibration):  # type: ignore[no-untyped-def]
        sched = KVCentricScheduler(LocalCacheAwarePrefill(cost, self.SLO), NoAdmission(SloAwareDecode(cost.decode)),
                                   self.SLO, calibration=calibration)
        return sched.schedule(self.REQUEST, [PrefillInstanceState("p", 0.0)],
                              [DecodeInstanceState("d", 0, 0, 10**6)], {}, now=0.0)

    def test_admission_judges_the_calibrated_prediction(self, cost) -> None:  # type: ignore[no-untyped-def]
        accepted = self.schedule(cost, learned([(1.0, 26.0)] * 8))
        assert accepted.accepted and accepted.prefill.ttft_s == pytest.approx(26.0)
        rejected = self.schedule(cost, learned([(1.0, 31.0)] * 8))
        assert not rejected.accepted and rejected.reason == "ttft_slo"
        assert rejected.prefill.ttft_s == pytest.approx(31.0) and rejected.retry_after_s == pytest.approx(1.0)

    def test_the_model_prediction_is_kept_for_learning(self, cost) -> None:  # type: ignore[no-untyped-def]
        decision = self.schedule(cost, learned([(1.0, 2.5)] * 8))
        assert decision.model_ttft_s == pytest.approx(1.0)
        assert decision.prefill.ttft_s == pytest.approx(2.5)
        assert decision.prefill.prefill_s == pytest.approx(1.0)  # the parts stay the model's
