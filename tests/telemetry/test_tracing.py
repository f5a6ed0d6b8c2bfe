"""Tracing: trace context crosses processes over NATS; JSONL and OTLP exporters really export."""

from __future__ import annotations

import asyncio
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import ClassVar

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from halfmoon.telemetry import extract_context, inject_headers, read_spans, setup_tracing

PEER = "tests/telemetry/trace_peer.py"


class TestCrossProcessParenting:
    def test_span_continued_from_nats_headers_in_another_process(self, nats_server, namespace, processes, tmp_path):
        trace_file = tmp_path / "spans.jsonl"
        subject = f"{namespace}.trace"
        args = [nats_server.url, subject, str(trace_file)]
        recv = processes.start([PEER, "recv", *args], stdout=subprocess.PIPE, text=True)
        assert recv.stdout.readline().strip() == "ready"
        send = processes.start([PEER, "send", *args])
        assert send.wait(timeout=60) == 0
        assert recv.wait(timeout=60) == 0

        spans = {s["name"]: s for s in read_spans(trace_file)}
        parent, child = spans["peer.send"], spans["peer.recv"]
        assert child["trace_id"] == parent["trace_id"]
        assert child["parent_id"] == parent["span_id"]
        assert parent["parent_id"] is None
        assert (parent["service"], child["service"]) == ("peer-send", "peer-recv")
        assert parent["attributes"] == {"hop": 1}
        assert child["start_ns"] <= child["end_ns"]


class TestJsonlConcurrentAppend:
    def test_many_processes_append_whole_lines(self, tmp_path, processes):
        trace_file = tmp_path / "spans.jsonl"
        code = (
            "import sys\nfrom halfmoon.telemetry import setup_tracing\n"
            "p = setup_tracing('w' + sys.argv[1], sys.argv[1], trace_file=sys.argv[2], env={})\n"
            "t = p.get_tracer('w')\n"
            "for i in range(300):\n"
            "    with t.start_as_current_span('s', attributes={'pad': 'x' * 500, 'i': i}): pass\n"
            "p.shutdown()\n"
        )
        writers = [processes.start(["-c", code, str(n), str(trace_file)]) for n in range(4)]
        assert [w.wait(timeout=60) for w in writers] == [0, 0, 0, 0]
        spans = read_spans(trace_file)  # a torn line would fail to parse here
        assert len(spans) == 1200
        for n in range(4):
            assert sorted(s["attributes"]["i"] for s in spans if s["service"] == f"w{n}") == list(range(300))


class _Collector(BaseHTTPRequestHandler):
    received: ClassVar[list[ExportTraceServiceRequest]] = []
    arrived = threading.Event()

    def do_POST(self) -> None:  # http.server's API names it
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        type(self).received.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        type(self).arrived.set()

    def log_message(self, *args) -> None:
        return None


class TestOtlpExporterChosenByEnv:
    def test_spans_reach_an_otlp_http_endpoint(self):
        server = HTTPServer(("127.0.0.1", 0), _Collector)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}
            provider = setup_tracing("gw", "gw-1", env=env)
            with provider.get_tracer("t").start_as_current_span("otlp.span"):
                pass
            provider.shutdown()
            assert _Collector.arrived.wait(10)
            spans = _Collector.received[0].resource_spans[0]
            attrs = {a.key: a.value.string_value for a in spans.resource.attributes}
            assert attrs["service.name"] == "gw" and attrs["service.instance.id"] == "gw-1"
            assert spans.scope_spans[0].spans[0].name == "otlp.span"
        finally:
            server.shutdown()

    def test_unknown_exporter_name_is_a_clear_error(self):
        with pytest.raises(ValueError, match="unsupported exporter 'zipkin'"):
            setup_tracing("gw", "gw-1", env={"OTEL_TRACES_EXPORTER": "zipkin"})

    def test_sdk_disabled_exports_nothing(self, tmp_path):
        provider = setup_tracing("gw", "gw-1", trace_file=str(tmp_path / "t.jsonl"), env={"OTEL_SDK_DISABLED": "true"})
        with provider.get_tracer("t").start_as_current_span("x"):
            pass
        provider.shutdown()
        assert not (tmp_path / "t.jsonl").exists()


class TestHeaderHelpers:
    async def test_inject_keeps_existing_headers_and_extract_round_trips(self, tmp_path):
        provider = setup_tracing("a", "a-1", env={})
        tracer = provider.get_tracer("t")
        with tracer.start_as_current_span("outer") as outer:
            headers = inject_headers({"x-request-id": "r1"})
        assert headers["x-request-id"] == "r1"
        assert headers["traceparent"].split("-")[2] == f"{outer.get_span_context().span_id:016x}"
        with tracer.start_as_current_span("inner", context=extract_context(headers)) as inner:
            assert inner.parent.span_id == outer.get_span_context().span_id
        await asyncio.sleep(0)
        provider.shutdown()

    def test_no_headers_gives_a_fresh_root(self):
        provider = setup_tracing("a", "a-1", env={})
        with provider.get_tracer("t").start_as_current_span("root", context=extract_context(None)) as span:
            assert span.parent is None
        provider.shutdown()
