"""One request, one trace: spans from every request-path service, correctly parented."""

from __future__ import annotations

import time

import httpx

from halfmoon.deploy.local import LocalCluster
from halfmoon.deploy.topology import REQUEST_PATH
from halfmoon.telemetry.jsonl import read_spans
from tests.e2e.conftest import AUTH, model_name


def spans_of_request(cluster: LocalCluster, request_id: str, deadline_s: float = 30.0,
                     names: frozenset[str] = frozenset()) -> list[dict]:
    """Poll the span file until the request's trace holds every request-path service and the spans
    ``names`` (or fail): each service exports its spans in its own batches, some after the reply."""
    end = time.monotonic() + deadline_s
    services: set[str] = set()
    while time.monotonic() < end:
        spans = read_spans(cluster.trace_file) if cluster.trace_file.exists() else []
        roots = [s for s in spans if s["attributes"].get("halfmoon.request_id") == request_id and s["service"] == "gateway"]
        if roots:
            trace_id = roots[0]["trace_id"]
            ours = [s for s in spans if s["trace_id"] == trace_id]
            services = {s["service"] for s in ours}
            if services >= set(REQUEST_PATH) and names <= {s["name"] for s in ours}:
                return ours
        time.sleep(0.2)
    raise AssertionError(f"trace of {request_id} only has spans from {sorted(services)}, wanted {sorted(names)} too")


class TestOneTracePerRequest:
    def test_spans_from_all_services_parented(self, cluster_2p2d: LocalCluster) -> None:
        reply = httpx.post(f"{cluster_2p2d.url}/v1/completions", headers=AUTH, timeout=60,
                           json={"model": model_name(cluster_2p2d), "prompt": "trace me " * 10, "max_tokens": 6,
                                 "temperature": 0})
        assert reply.status_code == 200
        expected = frozenset({"prefill.compute", "prefill.kv_write", "decode.kv_read", "decode.generate"})
        spans = spans_of_request(cluster_2p2d, reply.headers["x-request-id"], names=expected)
        by_id = {s["span_id"]: s for s in spans}
        roots = [s for s in spans if s["parent_id"] is None]
        assert len(roots) == 1 and roots[0]["service"] == "gateway"
        # the conductor's TTFT prediction and the TTFT delivered against it, from the placement on
        root = roots[0]["attributes"]
        assert root["halfmoon.ttft.predicted_ms"] > 0
        assert 0 < root["halfmoon.ttft.delivered_ms"] < (roots[0]["end_ns"] - roots[0]["start_ns"]) / 1e6
        # and the decode instance's predicted step time against the mean gap between the 6 tokens
        assert root["halfmoon.tbt.predicted_ms"] > 0
        assert 0 < root["halfmoon.tbt.delivered_ms"] < (roots[0]["end_ns"] - roots[0]["start_ns"]) / 1e6
        for span in spans:
            if span["parent_id"] is not None:
                parent = by_id[span["parent_id"]]
                assert parent["start_ns"] <= span["start_ns"]
        assert expected <= {s["name"] for s in spans}
        transfer = [s for s in spans if s["service"] == "transfer"]
        assert {by_id[s["parent_id"]]["service"] for s in transfer} >= {"prefill", "decode"}


class TestLayerwiseHandOffSpans:
    def test_decode_reads_each_layer_as_prefill_ships_it(self, cluster_2p2d: LocalCluster) -> None:
        reply = httpx.post(f"{cluster_2p2d.url}/v1/completions", headers=AUTH, timeout=60,
                           json={"model": model_name(cluster_2p2d), "prompt": "layer by layer " * 12,
                                 "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200
        end = time.monotonic() + 30
        while True:  # decode's layer reads are exported after the trace's request-path spans
            spans = spans_of_request(cluster_2p2d, reply.headers["x-request-id"])
            shipped = sorted(s["attributes"]["halfmoon.layers_done"] for s in spans if s["name"] == "prefill.kv_layers")
            read = sorted(s["attributes"]["halfmoon.layers_done"] for s in spans if s["name"] == "decode.kv_layers")
            if (shipped and read == shipped) or time.monotonic() > end:
                break
            time.sleep(0.2)
        layers = len(shipped)
        assert layers > 1 and shipped == list(range(1, layers + 1))  # one batch per layer, in order
        assert read == shipped  # decode read every layer as its own batch, before the hand-off
        by_id = {s["span_id"]: s for s in spans}
        first_read = next(s for s in spans if s["name"] == "decode.kv_layers"
                          and s["attributes"]["halfmoon.layers_done"] == 1)
        assert by_id[first_read["parent_id"]]["name"] == "prefill.kv_layers"  # caused by layer 0's announcement
        hand_off = next(s for s in spans if s["name"] == "decode.kv_read")
        assert hand_off["attributes"]["halfmoon.blocks_streamed"] >= 1
