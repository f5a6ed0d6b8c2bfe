import pytest

from halfmoon.sim.forecast import (
    ForecastError,
    Holt,
    IntervalLoad,
    LoadForecaster,
    Smoothing,
    forecast_error,
    trace_windows,
)
from halfmoon.sim.trace import TraceRequest


def ramp_trace(intervals: int, interval_s: float = 10.0) -> list[TraceRequest]:
    """Interval k holds k + 1 requests, evenly spread: a rate rising by 0.1 req/s per interval."""
    trace = []
    for k in range(intervals):
        for i in range(k + 1):
            trace.append(TraceRequest(k * interval_s + i * interval_s / (k + 1), 100, 10, (len(trace),)))
    return trace


class TestHolt:
    def test_follows_a_ramp_with_its_slope(self):
        holt = Holt(0.5, 0.3)
        for value in range(1, 31):
            holt.update(float(value))
        forecast = holt.forecast()
        assert forecast is not None and abs(forecast - 31.0) < 0.05  # the naive forecast (30) is 1 off

    def test_without_trend_it_lags_a_ramp(self):
        # the trend term is what follows a ramp: simple smoothing (beta 0) stays behind by a constant
        holt = Holt(0.5, 0.0)
        for value in range(1, 31):
            holt.update(float(value))
        forecast = holt.forecast()
        assert forecast is not None and forecast < 30.0

    def test_steady_series_forecasts_itself(self):
        holt = Holt(0.5, 0.3)
        for _ in range(20):
            holt.update(4.0)
        assert holt.forecast() == pytest.approx(4.0)

    @pytest.mark.parametrize(("alpha", "beta"), [(0.0, 0.3), (1.5, 0.3), (0.5, -0.1)])
    def test_rejects_weights_out_of_range(self, alpha, beta):
        with pytest.raises(ForecastError):
            Holt(alpha, beta)


class TestLoadForecaster:
    def test_nothing_to_forecast_before_an_interval_with_requests(self):
        forecaster = LoadForecaster()
        assert forecaster.forecast() is None
        forecaster.observe(IntervalLoad(0.0, 0.0, 0.0, 0.0), 0)
        assert forecaster.forecast() is None

    def test_an_idle_interval_moves_the_rate_not_the_lengths(self):
        forecaster = LoadForecaster(Smoothing(alpha=0.5, beta=0.0))
        forecaster.observe(IntervalLoad(2.0, 300.0, 20.0, 0.5), 10)
        forecaster.observe(IntervalLoad(0.0, 0.0, 0.0, 0.0), 0)
        forecast = forecaster.forecast()
        assert forecast == IntervalLoad(1.0, 300.0, 20.0, 0.5)

    def test_a_falling_rate_never_forecasts_below_zero(self):
        forecaster = LoadForecaster()
        for rate in (8.0, 4.0, 0.0, 0.0):
            forecaster.observe(IntervalLoad(rate, 100.0, 10.0, 0.0), int(rate))
        forecast = forecaster.forecast()
        assert forecast is not None and forecast.arrival_rps == 0.0


class TestTraceWindows:
    def test_rates_lengths_and_prefix_reuse(self):
        trace = [TraceRequest(0.0, 1024, 10, (1, 2)), TraceRequest(1.0, 1024, 30, (1, 3)),
                 TraceRequest(2.5, 600, 5, (4, 5))]
        windows = trace_windows(trace, interval_s=2.0)
        assert [n for _, n in windows] == [2, 1]
        first, second = windows[0][0], windows[1][0]
        assert first.arrival_rps == 1.0 and first.prompt_tokens == 1024 and first.output_tokens == 20
        assert first.reuse == pytest.approx(512 / 2048)  # the second request reuses block 1 (512 tokens)
        assert second.reuse == 0.0  # block 4 was never seen: reuse stops at the first miss

    def test_ramp_error_beats_the_naive_forecast(self):
        report = forecast_error(ramp_trace(30), interval_s=10.0)
        assert report.windows == 29
        # the ramp rises 0.1 req/s per interval: naive is 0.1 off each time, Holt only while its trend settles
        assert report.naive_mae_rps == pytest.approx(0.1)
        assert report.mae_rps < report.naive_mae_rps / 3

    def test_one_window_cannot_be_scored(self):
        with pytest.raises(ForecastError):
            forecast_error(ramp_trace(1), interval_s=10.0)
