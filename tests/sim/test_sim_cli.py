import argparse
import json

from halfmoon.cli import sim as sim_cli

TRACE = sim_cli.DEFAULT_TRACE  # the same ../shared kit path the replay tests use


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="halfmoon")
    sim_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["sim", *argv])


def summary_of(tmp_path, argv: list[str]) -> dict:
    """``halfmoon sim`` on the conversation trace with ``argv``: its JSON summary."""
    out = tmp_path / "summary.json"
    args = parse(["--trace", str(TRACE), *argv, "--json", str(out)])
    assert args.func(args) == 0
    return json.loads(out.read_text())


class TestSimCommand:
    def test_runs_and_writes_summary(self, tmp_path):
        summary = summary_of(tmp_path, ["--limit", "300", "--prefill-nodes", "2", "--decode-nodes", "2",
                                         "--pool-blocks", "unbounded"])
        assert summary["requests"] == 300
        assert summary["completed"] + summary["rejected_early"] + summary["rejected_late"] == 300
        assert summary["config"]["pool_blocks"] is None and summary["hit_rate"] > 0

    def test_the_mixed_layout_reports_the_requests_served_whole(self, tmp_path):
        summary = summary_of(tmp_path, ["--limit", "300", "--mode", "mixed", "--prefill-nodes", "2",
                                         "--decode-nodes", "1", "--aggregated-nodes", "1"])
        assert summary["config"]["aggregated_nodes"] == 1 and 0 < summary["served_whole"] < 300
        assert summary["completed"] + summary["rejected_early"] + summary["rejected_late"] == 300

    def test_coupled_prefix_defaults_to_a_cache_aware_router(self):
        args = parse(["--mode", "coupled", "--coupled-variant", "prefix", "--nodes", "4"])
        config = sim_cli.build_config(args, dram_tokens_per_node=3_000_000)
        assert (config.prefill_nodes, config.decode_nodes, config.coupled_router) == (4, 0, "local-cache-aware")
        assert config.pool_blocks == 4 * (3_000_000 // 512)

    def test_the_overload_wait_is_the_gateway_s_unless_set(self):
        from halfmoon.policy.admission import OVERLOAD_WAIT_S

        assert sim_cli.build_config(parse([]), 3_000_000).overload_wait_s == OVERLOAD_WAIT_S
        assert sim_cli.build_config(parse(["--overload-wait", "0"]), 3_000_000).overload_wait_s == 0.0

    def test_aggregated_nodes_under_admission_report_the_requests_that_waited(self, tmp_path):
        summary = summary_of(tmp_path, ["--limit", "1500", "--mode", "coupled", "--coupled-variant", "chunked",
                                         "--nodes", "4", "--admission", "predictive"])
        assert summary["waited"] > 0 and summary["config"]["overload_wait_s"] == 30.0

    def test_bad_trace_is_a_clean_error(self, tmp_path, capsys):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"timestamp": 0}\n')
        args = parse(["--trace", str(bad)])
        assert args.func(args) == 2
        assert "bad.jsonl:1" in capsys.readouterr().out
