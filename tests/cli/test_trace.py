"""`halfmoon trace` on real requests through a real deployment, and on Jaeger's JSON built from those spans."""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from halfmoon.cli.main import main
from halfmoon.cli.trace import build_waterfall, render_waterfall
from halfmoon.cli.trace_sources import (
    JsonlSource,
    Span,
    SpanEvent,
    TraceSourceError,
    jaeger_search_params,
    parse_jaeger,
)
from halfmoon.deploy.local import LocalCluster
from halfmoon.deploy.topology import REQUEST_PATH
from tests.e2e.conftest import AUTH, model_name, start_cluster

# sequential phases of one request: none overlaps another, so their durations add up within the total
PHASES = ("conductor.schedule", "prefill.compute", "prefill.kv_write", "decode.kv_read", "decode.generate")
_ROW = re.compile(r"^\s*(\d+\.\d+)\s+(\d+\.\d+)\s+([·█]+)\s+(\S+)\s+(\S+)\s+(.+?)(?:\s{2,}(\S.*?))?\s*$")
_SLOW = re.compile(r"^(\S+)\s+(\d+\.\d+)\s+(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\s+(\S+)\s+([0-9a-f]{32})\s*$")


class Row(NamedTuple):
    start_ms: float
    duration_ms: float
    bar: str
    service: str
    instance: str
    span: str
    attributes: str


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["trace", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def rows(output: str) -> list[Row]:
    found: list[Row] = []
    for line in output.splitlines():
        if m := _ROW.match(line):
            start, duration, bar, service, instance, span, attributes = m.groups()
            found.append(Row(float(start), float(duration), bar, service, instance, span.strip(), attributes or ""))
        elif found and line.strip():  # long attributes wrap onto the next line
            found[-1] = found[-1]._replace(attributes=f"{found[-1].attributes} {line.strip()}")
    return found


def wait_for_trace(trace_file: Path, request_id: str, deadline_s: float = 30.0) -> list[Span]:
    end = time.monotonic() + deadline_s
    names: set[str] = set()
    while time.monotonic() < end:
        spans = JsonlSource(trace_file).request_trace(request_id) if trace_file.exists() else []
        names = {s.name for s in spans}
        if set(PHASES) <= names and {s.service for s in spans} >= set(REQUEST_PATH):
            return spans
        time.sleep(0.1)
    raise AssertionError(f"trace of {request_id} incomplete: {sorted(names)}")


class Traced(NamedTuple):
    cluster: LocalCluster
    request_ids: list[str]


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    cluster = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("run-trace"))
    try:
        ids = []
        for max_tokens in (2, 12, 6):
            reply = httpx.post(
                f"{cluster.url}/v1/completions",
                headers=AUTH,
                timeout=60,
                json={
                    "model": model_name(cluster),
                    "prompt": "show me the waterfall " * 8,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            assert reply.status_code == 200, reply.text
            ids.append(reply.headers["x-request-id"])
        for request_id in ids:
            wait_for_trace(cluster.trace_file, request_id)
        yield Traced(cluster, ids)
    finally:
        cluster.stop()


class TestWaterfallOfARealRequest:
    def test_every_request_path_service_appears_within_the_total(
        self, traced: Traced, capsys: pytest.CaptureFixture[str]
    ) -> None:
        request_id = traced.request_ids[1]
        code, out, _ = run_cli(capsys, request_id, "--trace-file", str(traced.cluster.trace_file))
        assert code == 0
        header = re.search(r"request (\S+)\s+trace ([0-9a-f]{32})\s+total (\d+\.\d+) ms", out)
        assert header is not None and header.group(1) == request_id
        total = float(header.group(3))
        root = next(s for s in wait_for_trace(traced.cluster.trace_file, request_id) if s.parent_id is None)
        assert total == pytest.approx(root.duration_ns / 1e6, abs=0.01)
        table = rows(out)
        assert table[0].service == "gateway" and table[0].span == "gateway /v1/completions"
        assert table[0].start_ms == 0 and table[0].bar == "█" * len(table[0].bar)
        assert {r.service for r in table} >= set(REQUEST_PATH)
        assert all(r.start_ms >= 0 for r in table), [r for r in table if r.start_ms < 0]
        # the request's own phases run within its total; the pool's stores of a finished request's blocks may
        # start after the gateway's span ended (test_child_spans_start_inside_their_parent)
        phases = {r.span: r for r in table if r.span in PHASES}
        assert set(phases) == set(PHASES)
        assert all(r.start_ms <= total for r in phases.values()), [r for r in table if r.start_ms > total]
        assert sum(r.duration_ms for r in phases.values()) <= total
        ordered = [phases[name] for name in PHASES]  # each phase starts after the previous one ended
        for before, after in itertools.pairwise(ordered):
            assert before.start_ms + before.duration_ms <= after.start_ms + 0.01

    def test_key_attributes_are_shown(self, traced: Traced, capsys: pytest.CaptureFixture[str]) -> None:
        _, out, _ = run_cli(capsys, traced.request_ids[0], "--trace-file", str(traced.cluster.trace_file))
        by_span = {r.span: r for r in rows(out)}
        assert re.search(r"\bblocks_hit=\d+\b", by_span["prefill.compute"].attributes)
        assert re.search(r"\btokens_computed=[1-9]\d*\b", by_span["prefill.compute"].attributes)
        assert re.search(r"\bbytes=[1-9]\d*\b", by_span["decode.kv_read"].attributes)
        assert "tokens_generated=1" in by_span["decode.generate"].attributes  # 2 tokens: one from prefill
        assert {r.instance for r in rows(out)} >= {"gateway-0", "prefill-0", "decode-0", "transfer-0"}

    def test_child_spans_start_inside_their_parent(self, traced: Traced) -> None:
        spans = wait_for_trace(traced.cluster.trace_file, traced.request_ids[2])
        fall = build_waterfall(spans, traced.request_ids[2])
        by_id = {hop.span.span_id: hop for hop in fall.hops}
        assert len(fall.hops) == len(spans)
        for hop in fall.hops:
            if hop.span.parent_id is not None:
                parent = by_id[hop.span.parent_id]
                assert hop.depth == parent.depth + 1
                # not bounded by the total: the pool's stores of a finished request's blocks may start after
                # the gateway's span ended (seen under load: 0.8 ms after it)
                assert parent.offset_ms <= hop.offset_ms


class TestSlowest:
    def test_lists_requests_slowest_first(self, traced: Traced, capsys: pytest.CaptureFixture[str]) -> None:
        code, out, _ = run_cli(capsys, "--slowest", "5", "--trace-file", str(traced.cluster.trace_file))
        assert code == 0
        listed = [m.groups() for line in out.splitlines() if (m := _SLOW.match(line))]
        assert {row[0] for row in listed} == set(traced.request_ids)
        totals = [float(row[1]) for row in listed]
        assert totals == sorted(totals, reverse=True)
        slowest = max(
            (s for s in JsonlSource(traced.cluster.trace_file).recent_roots(100)), key=lambda s: s.duration_ns
        )
        assert listed[0][0] == slowest.attributes["halfmoon.request_id"]

    def test_limits_the_count(self, traced: Traced, capsys: pytest.CaptureFixture[str]) -> None:
        _, out, _ = run_cli(capsys, "--slowest", "2", "--trace-file", str(traced.cluster.trace_file))
        assert len([line for line in out.splitlines() if _SLOW.match(line)]) == 2


def jaeger_tag(key: str, value: Any) -> dict[str, Any]:
    kind = {bool: "bool", int: "int64", float: "float64"}.get(type(value), "string")
    return {"key": key, "type": kind, "value": value}


def jaeger_document(spans: list[Span]) -> dict[str, Any]:
    """What Jaeger's /api/traces answers for these spans (OTLP-ingested, microsecond times)."""
    traces: dict[str, dict[str, Any]] = {}
    for span in spans:
        trace = traces.setdefault(
            span.trace_id, {"traceID": span.trace_id, "spans": [], "processes": {}, "warnings": None}
        )
        pid = next((p for p, proc in trace["processes"].items() if proc["tags"][0]["value"] == span.instance), None)
        if pid is None:
            pid = f"p{len(trace['processes']) + 1}"
            trace["processes"][pid] = {
                "serviceName": span.service,
                "tags": [
                    jaeger_tag("service.instance.id", span.instance),
                    jaeger_tag("telemetry.sdk.language", "python"),
                ],
            }
        tags = [jaeger_tag(k, v) for k, v in span.attributes.items()]
        tags += [jaeger_tag("span.kind", "server"), jaeger_tag("internal.span.format", "otlp")]
        if span.status != "UNSET":
            tags.append(jaeger_tag("otel.status_code", span.status))
        refs = [{"refType": "CHILD_OF", "traceID": span.trace_id, "spanID": span.parent_id}] if span.parent_id else []
        trace["spans"].append(
            {
                "traceID": span.trace_id,
                "spanID": span.span_id,
                "flags": 1,
                "operationName": span.name,
                "references": refs,
                "startTime": span.start_ns // 1000,
                "duration": span.duration_ns // 1000,
                "logs": [{"timestamp": e.time_ns // 1000,
                          "fields": [jaeger_tag("event", e.name), *(jaeger_tag(k, v) for k, v in e.attributes.items())]}
                         for e in span.events],
                "tags": tags,
                "processID": pid,
                "warnings": None,
            }
        )
    return {"data": list(traces.values()), "total": 0, "limit": 0, "offset": 0, "errors": None}


class TestJaegerDocuments:
    def test_parsed_spans_match_the_exported_ones(self, traced: Traced) -> None:
        spans = wait_for_trace(traced.cluster.trace_file, traced.request_ids[0])
        parsed = {s.span_id: s for s in parse_jaeger(json.loads(json.dumps(jaeger_document(spans))))}
        assert set(parsed) == {s.span_id for s in spans}
        for span in spans:
            start = span.start_ns // 1000 * 1000
            events = tuple(e._replace(time_ns=e.time_ns // 1000 * 1000) for e in span.events)
            expected = span._replace(start_ns=start, end_ns=start + span.duration_ns // 1000 * 1000, events=events)
            assert parsed[span.span_id] == expected

    def test_the_waterfall_is_the_same_from_either_source(self, traced: Traced) -> None:
        request_id = traced.request_ids[0]
        spans = wait_for_trace(traced.cluster.trace_file, request_id)
        from_file = build_waterfall(spans, request_id)
        from_jaeger = build_waterfall(parse_jaeger(jaeger_document(spans)), request_id)
        assert [h.span.span_id for h in from_jaeger.hops] == [h.span.span_id for h in from_file.hops]
        assert from_jaeger.total_ms == pytest.approx(from_file.total_ms, abs=0.002)

    def test_an_error_tag_marks_the_span_failed(self) -> None:
        doc = {
            "data": [
                {
                    "traceID": "ab" * 16,
                    "processes": {"p1": {"serviceName": "decode", "tags": []}},
                    "spans": [
                        {
                            "traceID": "ab" * 16,
                            "spanID": "cd" * 8,
                            "operationName": "decode.generate",
                            "references": [],
                            "startTime": 1_700_000_000_000_000,
                            "duration": 1500,
                            "tags": [jaeger_tag("error", True), jaeger_tag("halfmoon.bytes", 64)],
                            "processID": "p1",
                        }
                    ],
                }
            ]
        }
        (span,) = parse_jaeger(doc)
        assert span.status == "ERROR" and span.attributes == {"halfmoon.bytes": 64}
        assert span.duration_ns == 1_500_000 and span.service == "decode" and span.instance == ""

    def test_a_malformed_document_is_a_typed_error(self) -> None:
        with pytest.raises(TraceSourceError, match="not a Jaeger traces document"):
            parse_jaeger({"data": [{"traceID": "ab", "spans": [{"spanID": "cd"}]}]})

    def test_search_query_selects_the_request_by_tag(self) -> None:
        params = jaeger_search_params("cmpl-42", 1, "2h")
        assert params["service"] == "gateway" and params["lookback"] == "2h" and params["limit"] == "1"
        assert json.loads(params["tags"]) == {"halfmoon.request_id": "cmpl-42"}
        assert "tags" not in jaeger_search_params(None, 50, "1h")


class TestSpanEvents:
    def test_a_migration_shows_inside_the_gateway_span(self, capsys: pytest.CaptureFixture[str]) -> None:
        from rich.console import Console

        event = SpanEvent("migration", 1_500_000_000, {"halfmoon.reason": "decode-0 went down", "halfmoon.attempt": 1})
        root = Span("ab" * 16, "cd" * 8, None, "gateway /v1/completions", "gateway", "gateway-0", 1_000_000_000,
                    3_000_000_000, "OK", {"halfmoon.request_id": "cmpl-1"}, (event,))
        render_waterfall(build_waterfall([root], "cmpl-1"), Console(width=200))
        out = capsys.readouterr().out
        assert "! migration" in out and "reason=decode-0 went down" in out and "attempt=1" in out
        assert "500.00" in out  # half a second into the request


class TestBadInput:
    def test_unknown_request_is_reported(self, traced: Traced, capsys: pytest.CaptureFixture[str]) -> None:
        code, out, err = run_cli(capsys, "cmpl-missing", "--trace-file", str(traced.cluster.trace_file))
        assert code == 1 and out == "" and "no trace holds request 'cmpl-missing'" in err

    def test_missing_file_is_reported(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        code, _, err = run_cli(capsys, "--slowest", "3", "--trace-file", str(tmp_path / "none.jsonl"))
        assert code == 1 and "cannot read spans" in err

    def test_needs_a_request_or_slowest(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert run_cli(capsys, "--trace-file", str(tmp_path / "x.jsonl"))[0] == 2
        assert run_cli(capsys, "cmpl-1", "--slowest", "2", "--trace-file", str(tmp_path / "x.jsonl"))[0] == 2

    def test_a_corrupt_line_is_named_but_a_half_written_last_line_is_skipped(
        self, traced: Traced, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        lines = traced.cluster.trace_file.read_text().splitlines()
        torn = tmp_path / "torn.jsonl"
        torn.write_text("\n".join(lines) + "\n" + lines[-1][: len(lines[-1]) // 2])
        assert run_cli(capsys, traced.request_ids[0], "--trace-file", str(torn))[0] == 0
        corrupt = tmp_path / "corrupt.jsonl"
        corrupt.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
        code, _, err = run_cli(capsys, traced.request_ids[0], "--trace-file", str(corrupt))
        assert code == 1 and f"{corrupt}:2" in err.replace("\n", "")
