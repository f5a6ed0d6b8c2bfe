"""Reading aiperf's per-request records: the figures benchmarks.peers compares against a peer."""

from __future__ import annotations

import json

from benchmarks.aiperf_driver import (
    AiperfLoad,
    RequestSLO,
    command,
    offline_tokenizer,
    spread,
    summarise,
    trace_slice,
)
from benchmarks.peers import pairing_rows, round_rows


def record(session: int, start_s: float, end_s: float, phase: str = "profiling", error: int | None = None,
           ttft_ms: float = 100.0, itl_ms: float = 50.0, out: int = 10, prompt: int = 64, cached: int = 0) -> dict:
    meta = {"session_num": session, "benchmark_phase": phase, "request_start_ns": int(start_s * 1e9),
            "request_end_ns": int(end_s * 1e9)}
    if error is not None:
        return {"metadata": meta, "metrics": {}, "error": {"code": error, "message": "no"}}
    metrics = {"time_to_first_token": ttft_ms, "inter_token_latency": itl_ms, "output_token_count": out,
               "usage_prompt_tokens": prompt, "usage_prompt_cache_read_tokens": cached}
    return {"metadata": meta, "metrics": {k: {"value": v} for k, v in metrics.items()}, "error": None}


class TestSummarise:
    def test_figures_outcomes_and_warmup(self):
        records = [record(0, 0, 1, phase="warmup", out=1000),
                   record(2, 1, 3, ttft_ms=3000),  # served, TTFT over the SLO
                   record(1, 1, 2, cached=32),
                   record(3, 2, 5, error=429),
                   record(4, 2, 3, itl_ms=500)]
        summary = summarise(records, RequestSLO(ttft_ms=2000, itl_ms=100))
        assert summary["outcomes"] == ["met", "missed", "rejected", "missed"]  # by session, warm-up left out
        assert summary["rejected"] == 1 and summary["errors"] == {"429": 1}
        assert summary["duration_s"] == 4.0
        assert summary["output_throughput"] == 30 / 4.0
        assert summary["goodput"] == {"met": 1, "share": 0.25}
        assert summary["cached_prompt_share"] == 32 / 192
        assert summary["ttft_ms"]["p50"] == 100.0 and summary["ttft_ms"]["p99"] == 3000

    def test_the_spread_is_what_saying_the_median_for_every_request_would_miss_by(self):
        ttfts = (1000.0, 1000.0, 2000.0, 4000.0, 500.0)
        records = [record(i, i, i + 1, ttft_ms=t, itl_ms=80.0) for i, t in enumerate(ttfts)]
        summary = summarise(records, RequestSLO(ttft_ms=2000, itl_ms=100))
        # median 1000 ms: |error| 0, 0, 0.5, 0.75 and 1.0 of each request's own TTFT
        assert summary["ttft_spread"] == 0.5
        assert summary["itl_spread"] == 0.0  # one ITL for all: the median predicts every request
        assert spread([]) is None


class TestTraceSlice:
    def test_scales_prompts_caps_outputs_and_rebases_time(self, tmp_path):
        source = tmp_path / "trace.jsonl"
        rows = [{"timestamp": t, "input_length": n, "output_length": o, "hash_ids": list(range(n // 512 + 1))}
                for t, n, o in ((0, 100, 5), (1000, 6758, 500), (2500, 1024, 40))]
        source.write_text("".join(json.dumps(r) + "\n" for r in rows))
        sliced = trace_slice(source, tmp_path / "slice.jsonl", 1, 5, 16, 32)
        got = [json.loads(line) for line in sliced.read_text().splitlines()]
        assert [(r["timestamp"], r["input_length"], r["output_length"]) for r in got] == [(0, 212, 32), (1500, 32, 32)]
        assert got[0]["hash_ids"] == rows[1]["hash_ids"]
        slower = trace_slice(source, tmp_path / "slower.jsonl", 0, 5, 16, 32, speedup=0.5)
        assert [json.loads(line)["timestamp"] for line in slower.read_text().splitlines()] == [0, 2000, 5000]

    def test_the_trace_command_replays_the_schedule(self, tmp_path):
        load = AiperfLoad(8, trace_file=tmp_path / "slice.jsonl", isl_block_size=16)
        cmd = command("aiperf", "m", "http://127.0.0.1:1", "halfmoon/tiny", load, tmp_path / "out")
        assert cmd[cmd.index("--custom-dataset-type") + 1] == "mooncake_trace"
        assert "--fixed-schedule" in cmd and "--concurrency" not in cmd
        assert cmd[cmd.index("--isl-block-size") + 1] == "16"

    def test_the_tokenizer_loads_offline_from_a_hub_cache_layout(self, tmp_path, tiny_model_dir):
        from transformers import AutoTokenizer

        name = offline_tokenizer(tiny_model_dir, tmp_path / "hub")
        offline = AutoTokenizer.from_pretrained(name, cache_dir=tmp_path / "hub", local_files_only=True)
        direct = AutoTokenizer.from_pretrained(tiny_model_dir)
        assert offline("a prompt of a few words")["input_ids"] == direct("a prompt of a few words")["input_ids"]


class TestFalseRejections:
    @staticmethod
    def run(*outcomes: str) -> dict:
        return {"fixed": {"outcomes": list(outcomes), "goodput": {"met": outcomes.count("met")}}}

    def test_each_run_is_paired_with_its_twin_without_admission_beside_a_busy_loop_too(self):
        results = {"halfmoon": self.run("met", "rejected"), "halfmoon-no-admission": self.run("met", "met"),
                   "halfmoon+busy": self.run("rejected", "rejected", "met"),
                   "halfmoon-no-admission+busy": self.run("met", "missed", "met"), "vllm": self.run("met", "met")}
        rows = {row[0]: row[1:] for row in pairing_rows(results)}
        assert rows == {"halfmoon": ["fixed", "1", "1", "1/1", "2"], "halfmoon+busy": ["fixed", "2", "1", "1/1", "2"]}


class TestRounds:
    @staticmethod
    def fixed(tok_s: float, ttft_ms: float) -> dict:
        return {"fixed": {"output_throughput": tok_s, "ttft_ms": {"p50": ttft_ms}}}

    def test_each_round_s_ratio_their_median_and_the_rounds_on_the_better_side(self):
        rounds = [{"vllm": self.fixed(60, 3000), "halfmoon": self.fixed(63, 2900)},
                  {"vllm": self.fixed(60, 3000), "halfmoon": self.fixed(57, 3300)},
                  {"vllm": self.fixed(50, 4000), "halfmoon": self.fixed(55, 3600)},
                  {"vllm": self.fixed(60, 3000)}]  # halfmoon failed to start in the last round
        rows = {row[1]: row[2:] for row in round_rows(rounds, ["vllm", "halfmoon"], "vllm")}
        assert rows["fixed: output tok/s"] == ["1.05x", "0.95x", "1.10x", "-", "1.05x", "2/3"]
        assert rows["fixed: TTFT p50 (ms)"] == ["0.97x", "1.10x", "0.90x", "-", "0.97x", "2/3"]
        assert "fixed: ITL p50 (ms)" not in rows  # measured in no round
