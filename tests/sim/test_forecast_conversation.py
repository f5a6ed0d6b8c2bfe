from halfmoon.sim.forecast import Smoothing, forecast_error


def test_holt_beats_the_naive_forecast_on_the_conversation_trace(conversation):
    # the figures in docs/PLANNER.md; the trace is noisy, so the lighter weights do better on it
    default, light = forecast_error(conversation, 30.0), forecast_error(conversation, 30.0, Smoothing(0.3, 0.1))
    assert default.windows == light.windows == 117
    assert light.mae_rps < default.mae_rps < default.naive_mae_rps
    assert default.mae_rps / default.mean_rps < 0.16
