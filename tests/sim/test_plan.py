import argparse
import json

import pytest

from halfmoon.cli import plan as plan_cli
from halfmoon.cli.trace_sources import Span, logged_requests
from halfmoon.policy.state import SLO
from halfmoon.sim.config import SimConfig
from halfmoon.sim.plan import AGGREGATED, DISAGGREGATED, Candidate, Layout, PlanError, PlanSettings, plan, window
from halfmoon.sim.trace import TraceRequest

PROMPT = 32_000  # prefills in about 4.7 s on one node of the bundled profile
BURST = 4


def burst(profile, requests: int = BURST) -> tuple[list[TraceRequest], float]:
    """``requests`` long prompts at once, no shared blocks, two output tokens each; with a TTFT SLO of
    1.5 prefills a request meets it only on a prefill node of its own, so attainment with P prefill
    (or aggregated) instances is min(P, requests) / requests, and one decode instance is always enough."""
    blocks = -(-PROMPT // 512)
    trace = [TraceRequest(0.0, PROMPT, 2, tuple(range(i * blocks, (i + 1) * blocks))) for i in range(requests)]
    return trace, 1.5 * profile.cost.prefill.predict(PROMPT, 0)


def settings(ttft_s: float, target: float, **kw) -> PlanSettings:
    return PlanSettings(SimConfig(slo=SLO(ttft_s=ttft_s, tbt_s=0.1)), target=target, max_instances=12, **kw)


class TestSearch:
    @pytest.mark.parametrize(("target", "prefill"), [(1.0, 4), (0.75, 3), (0.5, 2)])
    def test_finds_the_fewest_disaggregated_instances(self, profile, target, prefill):
        trace, ttft = burst(profile)
        result = plan(profile, trace, settings(ttft, target, aggregated=False))
        assert result.choice is not None
        assert result.choice.layout == Layout(DISAGGREGATED, prefill, 1)
        assert result.choice.attainment >= target
        smaller = [c for c in result.candidates if c.layout.instances < result.choice.layout.instances]
        assert smaller and not any(c.meets for c in smaller)

    def test_more_instances_never_lower_attainment_here(self, profile):
        trace, ttft = burst(profile)
        result = plan(profile, trace, settings(ttft, 1.0, aggregated=False))
        for a in result.candidates:
            for b in result.candidates:
                if a.layout.prefill <= b.layout.prefill and a.layout.decode <= b.layout.decode:
                    assert a.attainment <= b.attainment

    def test_aggregated_wins_a_tie_broken_by_fewer_instances(self, profile):
        # aggregated instances prefill in parallel too, and need no separate decode instance
        trace, ttft = burst(profile)
        result = plan(profile, trace, settings(ttft, 1.0))
        assert result.choice is not None and result.choice.layout == Layout(AGGREGATED, 4)
        assert any(c.layout.mode == DISAGGREGATED for c in result.candidates)

    def test_searches_far_less_than_the_grid(self, profile):
        trace, ttft = burst(profile)
        result = plan(profile, trace, settings(ttft, 1.0, aggregated=False))
        grid = 11 * 11  # every P, D in 1..11
        assert len(result.candidates) < grid // 5

    def test_an_unreachable_target_says_why(self, profile):
        # one prompt no single node can prefill within the SLO caps attainment below the target
        trace, _ = burst(profile)
        huge = TraceRequest(0.0, 200_000, 2, tuple(range(10_000, 10_000 + 391)))
        result = plan(profile, [*trace, huge], settings(30.0, 1.0, aggregated=False))
        assert result.choice is None
        assert "no layout of at most 12 instances" in result.reason and "--cpp" in result.reason

    def test_cpp_reaches_what_single_nodes_cannot(self, profile):
        huge = TraceRequest(0.0, 200_000, 2, tuple(range(391)))
        result = plan(profile, [huge], settings(30.0, 1.0, aggregated=False, cpp_stages=(4,)))
        assert result.choice is not None and result.choice.layout.cpp_stages == 4
        assert result.choice.layout.prefill >= 4


class TestSearchOnAConstructedSurface:
    """The search alone, on an attainment surface whose minimum is known: the layout meets the
    target when P >= 3, D >= 2 and P + 2 D >= 11 (monotone in both roles); the fewest instances are 3P+4D."""

    @staticmethod
    def surface(layout: Layout) -> Candidate:
        p, d = layout.prefill, layout.decode
        ok = p >= 3 and d >= 2 and p + 2 * d >= 11
        share = 1.0 if ok else 0.5 * min(1.0, (p + 2 * d) / 11)
        return Candidate(layout, share, share, 1.0, 0.05, 0, ok, 0.0)

    def test_minimum_of_the_surface(self, profile):
        result = plan(profile, [TraceRequest(0.0, 1, 1, ())], settings(30.0, 0.9, aggregated=False), self.surface)
        assert result.choice is not None and result.choice.layout.instances == 7
        assert (result.choice.layout.prefill, result.choice.layout.decode) == (3, 4)
        assert all(not c.meets for c in result.candidates if c.layout.instances < 7)


class TestWindow:
    def test_shifts_arrivals_to_zero(self):
        trace = [TraceRequest(float(t), 10, 2, ()) for t in range(5)]
        assert [r.arrival_s for r in window(trace, 2, 2)] == [0.0, 1.0]

    def test_empty_window_is_an_error(self):
        with pytest.raises(PlanError, match="holds no request"):
            window([TraceRequest(0.0, 10, 2, ())], 5)

    @pytest.mark.parametrize("target", [0.0, -0.1, 1.5])
    def test_target_outside_unit_interval(self, target):
        with pytest.raises(PlanError, match=r"\(0, 1\]"):
            PlanSettings(SimConfig(), target=target)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="halfmoon")
    plan_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["plan", *argv])


def write_trace(path, trace: list[TraceRequest]) -> None:
    path.write_text("".join(json.dumps({"timestamp": int(r.arrival_s * 1000), "input_length": r.input_length,
                                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                            for r in trace))


class TestPlanCommand:
    def test_prints_the_table_and_writes_plot_and_json(self, tmp_path, profile, capsys, monkeypatch):
        monkeypatch.setenv("COLUMNS", "160")  # one table row a line
        trace, ttft = burst(profile)
        write_trace(tmp_path / "t.jsonl", trace)
        out, fig = tmp_path / "plan.json", tmp_path / "plan.png"
        args = parse(["--trace", str(tmp_path / "t.jsonl"), "--ttft-slo", str(ttft), "--target", "1",
                      "--max-instances", "8", "--no-aggregated", "--plot", str(fig), "--json", str(out)])
        assert args.func(args) == 0
        printed = capsys.readouterr().out
        assert "choice: 4P+1D is the fewest instances" in printed
        assert "3P+4D" in printed and "attainment" in printed  # the bisection's last miss
        assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        summary = json.loads(out.read_text())
        assert summary["choice"]["label"] == "4P+1D" and summary["requests"] == BURST

    def test_window_of_the_trace(self, tmp_path, profile, capsys):
        trace, ttft = burst(profile, 6)
        write_trace(tmp_path / "t.jsonl", trace)
        out = tmp_path / "plan.json"
        args = parse(["--trace", str(tmp_path / "t.jsonl"), "--offset", "1", "--limit", "2", "--ttft-slo", str(ttft),
                      "--target", "1", "--no-aggregated", "--plot", str(tmp_path / "p.png"), "--json", str(out)])
        assert args.func(args) == 0
        assert json.loads(out.read_text())["choice"]["label"] == "2P+1D"

    def test_missing_trace_is_a_clean_error(self, tmp_path, capsys):
        args = parse(["--trace", str(tmp_path / "absent.jsonl"), "--plot", str(tmp_path / "p.png")])
        assert args.func(args) == 2
        assert "trace not found" in capsys.readouterr().out
        assert not (tmp_path / "p.png").exists()

    @pytest.mark.parametrize("target", ["0", "1.2"])
    def test_target_out_of_range_is_a_clean_error(self, tmp_path, capsys, target):
        args = parse(["--target", target, "--plot", str(tmp_path / "p.png")])
        assert args.func(args) == 2
        assert "target must be in (0, 1]" in capsys.readouterr().out


class TestLoggedRequests:
    @staticmethod
    def span(trace_id: str, service: str, start_s: float, **attributes) -> Span:
        return Span(trace_id, f"{trace_id}-{service}", None, service, service, "i0", int(start_s * 1e9),
                    int(start_s * 1e9) + 1, "OK", attributes)

    def test_requests_from_gateway_and_decode_spans(self):
        spans = [
            self.span("t1", "gateway", 10.0, **{"halfmoon.request_id": "a", "halfmoon.prompt_tokens": 600}),
            self.span("t1", "decode", 10.5, **{"halfmoon.tokens_generated": 7}),
            self.span("t2", "gateway", 12.5, **{"halfmoon.request_id": "b", "halfmoon.prompt_tokens": 100}),
            self.span("t2", "decode", 13.0, **{"halfmoon.tokens_generated": 3}),
            self.span("t2", "decode", 13.5, **{"halfmoon.tokens_generated": 2}),  # resumed after a migration
            self.span("t3", "gateway", 13.0, **{"halfmoon.request_id": "c", "halfmoon.prompt_tokens": 50}),
        ]
        requests, skipped = logged_requests(spans, block_size=512)
        assert skipped == 1  # t3 never reached decode
        assert [(r.arrival_s, r.input_length, r.output_length) for r in requests] == [(0.0, 600, 8), (2.5, 100, 6)]
        assert requests[0].hash_ids == (0, 1) and requests[1].hash_ids == (2,)
