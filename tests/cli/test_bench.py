"""`halfmoon bench` against a real in-process OpenAI-compatible server and against a real Halfmoon deployment."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from halfmoon.cli import main as cli_main
from halfmoon.cli.bench import parse_prediction_error, prediction_error
from halfmoon.cli.bench_stats import false_rejections
from halfmoon.cli.bench_workload import TraceScaling, trace_requests
from halfmoon.deploy.local import LocalCluster
from halfmoon.sim.trace import load_trace
from halfmoon.telemetry.metrics import Metrics
from tests.cli.openai_stub import Serving, StubServer
from tests.e2e.conftest import API_KEY, start_cluster

SUMMARY_FIELDS = {"requests", "completed", "failed", "errors", "duration_s", "request_throughput", "output_throughput",
                  "ttft_ms", "itl_ms", "tpot_ms", "goodput", "cached_prompt_share"}
# (timestamp ms, input tokens, output tokens, hash ids): requests 1-3 extend one conversation's prefix
TRACE = [(0, 700, 9, [0, 1]), (100, 1500, 9, [0, 2, 3]), (250, 2000, 7, [0, 2, 3, 4]), (300, 900, 5, [0, 5]),
         (600, 2500, 8, [0, 2, 3, 4, 6]), (900, 400, 9, [7])]


@pytest.fixture
def stub() -> Iterator[tuple[StubServer, str]]:
    server = StubServer(first_s=0.05, token_s=0.02, fail_every=5, stream_error_at=3)
    serving = Serving(server).start()
    yield server, serving.base_url
    serving.stop()


def bench(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "bench.json"
    code = cli_main.main(["bench", *args, "--json", str(out)])
    return code, json.loads(out.read_text()) if out.exists() else {}


def write_trace(path: Path) -> Path:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h}) + "\n"
                            for t, n, o, h in TRACE))
    return path


class TestCommandList:
    def test_help_lists_bench(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as done:
            cli_main.main(["--help"])
        assert done.value.code == 0
        assert "bench" in capsys.readouterr().out

    def test_a_listed_command_that_fails_to_import_raises(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        (tmp_path / "halfmoon_broken_command.py").write_text("import halfmoon_no_such_dependency\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setattr(cli_main, "_COMMANDS", (*cli_main._COMMANDS, "halfmoon_broken_command"))
        with pytest.raises(ModuleNotFoundError, match="halfmoon_no_such_dependency"):
            cli_main.build_parser()
        sys.modules.pop("halfmoon_broken_command", None)

    def test_a_listed_command_that_does_not_exist_raises(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(cli_main, "_COMMANDS", (*cli_main._COMMANDS, "halfmoon.cli.no_such_command"))
        with pytest.raises(ModuleNotFoundError, match="no_such_command"):
            cli_main.build_parser()


class TestFixedConcurrency:
    def test_counts_errors_timing_and_concurrency(self, stub: tuple[StubServer, str], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
        server, url = stub
        code, report = bench(tmp_path, "--base-url", url, "--concurrency", "3", "--requests", "10", "--warmup", "2",
                             "--isl", "32", "--osl", "5", "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000")
        assert code == 0
        summary = report["summary"]
        assert summary.keys() >= SUMMARY_FIELDS
        assert report["config"]["model"] == "stub-model"
        assert len(server.seen) == 12  # two warm-up requests, then ten measured
        assert all(len(s.body["prompt"]) == 32 and s.body["max_tokens"] == 5 and s.body["ignore_eos"]
                   for s in server.seen)
        assert 2 <= server.peak_in_flight <= 3
        # the server answers its 5th and 10th request with 429; both are measured ones
        assert (summary["requests"], summary["completed"], summary["failed"]) == (10, 8, 2)
        assert summary["errors"] == {"429": 2}
        assert summary["output_tokens"] == 8 * 5
        assert summary["ttft_ms"]["p50"] >= 50 and summary["itl_ms"]["p50"] >= 20
        assert summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p90"] <= summary["ttft_ms"]["p99"]
        assert summary["goodput"]["met"] == 8 and summary["goodput"]["share"] == pytest.approx(0.8)
        assert sorted(summary["outcomes"]) == ["met"] * 8 + ["rejected"] * 2
        out = capsys.readouterr().out
        assert "429: 2" in out and "goodput" in out

    def test_goodput_counts_only_requests_within_the_slos(self, stub: tuple[StubServer, str], tmp_path: Path) -> None:
        _server, url = stub
        code, report = bench(tmp_path, "--base-url", url, "--concurrency", "2", "--requests", "4", "--warmup", "0",
                             "--isl", "8", "--osl", "4", "--slo-ttft-ms", "60000", "--slo-itl-ms", "1")
        assert code == 0
        assert report["summary"]["completed"] == 4 and report["summary"]["goodput"]["met"] == 0

    def test_an_error_inside_the_stream_fails_the_request(self, stub: tuple[StubServer, str], tmp_path: Path) -> None:
        _server, url = stub
        code, report = bench(tmp_path, "--base-url", url, "--concurrency", "2", "--requests", "3", "--warmup", "0",
                             "--isl", "8", "--osl", "3")
        assert code == 1  # nothing completed
        assert report["summary"]["errors"] == {"stream": 3}


class TestRetryAfter:
    """A fixed-concurrency slot answered 429 waits out Retry-After (capped) before it sends again."""

    @pytest.mark.parametrize(("cap", "gap_at_least", "gap_below"), [("0.4", 0.4, 5.0), ("0", 0.0, 0.4)])
    def test_the_next_request_waits_for_the_capped_retry_after(self, tmp_path: Path, cap: str, gap_at_least: float,
                                                               gap_below: float) -> None:
        server = StubServer(first_s=0.01, token_s=0.01, fail_every=2, retry_after="5")
        serving = Serving(server).start()
        try:
            code, report = bench(tmp_path, "--base-url", serving.base_url, "--concurrency", "1", "--requests", "3",
                                 "--warmup", "0", "--isl", "8", "--osl", "2", "--max-backoff-s", cap)
        finally:
            serving.stop()
        assert code == 0 and report["summary"]["errors"] == {"429": 1}
        rejected, after = server.seen[1], server.seen[2]
        assert gap_at_least <= after.received_at - rejected.received_at < gap_below


class TestTraceReplay:
    def test_prompts_share_tokens_where_the_trace_shares_blocks(self, tmp_path: Path) -> None:
        reqs = trace_requests(load_trace(write_trace(tmp_path / "t.jsonl")), TraceScaling(block_tokens=4))
        assert [len(r.prompt) for r in reqs] == [math.ceil(n * 4 / 512) for _t, n, _o, _h in TRACE]
        assert reqs[1].prompt[:4] == reqs[0].prompt[:4] and reqs[1].prompt[4:6] != reqs[0].prompt[4:6]
        assert reqs[2].prompt[:12] == reqs[1].prompt[:12]
        assert reqs[5].prompt[:4] != reqs[0].prompt[:4]
        assert [r.arrival_s for r in reqs] == [t / 1000 for t, *_ in TRACE]

    def test_replays_a_slice_at_its_pace_and_reports_reuse(self, stub: tuple[StubServer, str], tmp_path: Path) -> None:
        server, url = stub
        server.fail_every = 0
        trace = write_trace(tmp_path / "t.jsonl")
        code, report = bench(tmp_path, "--base-url", url, "--trace", str(trace), "--offset", "1", "--limit", "4",
                             "--isl-block-size", "4", "--speedup", "0.5", "--max-output-tokens", "6", "--warmup", "0")
        assert code == 0
        summary = report["summary"]
        assert (summary["requests"], summary["completed"]) == (4, 4)
        # 2nd and 3rd arrive 0.1 s apart: a loaded machine may deliver them in either order
        assert sorted(s.body["max_tokens"] for s in server.seen) == [5, 6, 6, 6]
        # arrivals 100..600 ms of the trace at half speed: the last request starts at least 1 s after the first
        assert server.seen[-1].received_at - server.seen[0].received_at >= 0.95
        # prompts of 12, 16, 8 and 20 tokens; the 2nd reuses the 1st's 12, the 3rd block 0 (4), the 4th the 2nd's 16
        assert summary["cached_prompt_share"] == pytest.approx((12 + 4 + 16) / (12 + 16 + 8 + 20))

    def test_a_missing_trace_is_a_clear_error(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        code = cli_main.main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--trace", str(tmp_path / "none.jsonl")])
        assert code == 2
        assert "trace not found" in capsys.readouterr().err


class TestFalseRejections:
    def test_rejected_here_but_met_without_admission(self) -> None:
        admitted = ["met", "rejected", "rejected", "missed", "failed", "rejected"]
        unguarded = ["met", "met", "missed", "missed", "met", "failed"]
        assert false_rejections(admitted, unguarded) == {"rejected": 3, "false": 1, "accepted_met": 1, "accepted": 2}

    def test_runs_of_other_requests_cannot_be_paired(self) -> None:
        with pytest.raises(ValueError, match="differ in length"):
            false_rejections(["met"], ["met", "met"])


class TestPredictionError:
    def test_quantiles_of_the_requests_between_two_scrapes(self) -> None:
        metrics = Metrics()
        metrics.record_ttft_prediction(5.0, 0.1)  # before the run: not counted
        before = parse_prediction_error(metrics.render().decode())
        for predicted in (1.15, 1.25, 1.4, 1.6):  # delivered 1 s: errors 0.15, 0.25, 0.4, 0.6, over
            metrics.record_ttft_prediction(predicted, 1.0)
        metrics.record_ttft_prediction(0.8, 1.0)  # error 0.2, under
        got = prediction_error(before, parse_prediction_error(metrics.render().decode()))
        assert got["count"] == 5 and got["over_share"] == pytest.approx(0.8)
        # as Prometheus's histogram_quantile: cumulative 2 at le=0.2, 3 at 0.3, 4 at 0.5, 5 at 0.75; linear inside
        assert got["p50"] == pytest.approx(0.25)
        assert got["p90"] == pytest.approx(0.625)

    def test_no_predictions_gives_no_quantiles(self) -> None:
        empty = parse_prediction_error(Metrics().render().decode())
        assert prediction_error(empty, empty) == {"count": 0, "p50": None, "p90": None, "over_share": None}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("run-bench"))
    yield cluster
    cluster.stop()


class TestAgainstHalfmoon:
    def test_fixed_run_and_ttft_prediction_error(self, cluster: LocalCluster, tmp_path: Path) -> None:
        code, report = bench(tmp_path, "--base-url", f"{cluster.url}/v1", "--api-key", API_KEY, "--concurrency", "2",
                             "--requests", "4", "--warmup", "1", "--isl", "48", "--osl", "4", "--metrics-url", f"{cluster.url}/metrics")
        assert code == 0
        summary = report["summary"]
        assert (summary["completed"], summary["failed"], summary["output_tokens"]) == (4, 0, 16)
        prediction = summary["prediction_error"]
        assert prediction["count"] == 4  # the measured requests only, not the warm-up
        assert prediction["p50"] is not None and prediction["p50"] <= prediction["p90"]
