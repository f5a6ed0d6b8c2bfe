"""The gateway as a real process, and one request traced across gateway, conductor and prefill."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import httpx
from fake_engine import IdleDecode, Script, ScriptedPrefill
from test_gateway_generation import wait_for

from halfmoon.runtime import ServiceConfig, ServiceHost
from halfmoon.services.conductor.service import ConductorConfig, ConductorService
from halfmoon.services.gateway.service import GatewayConfig, GatewayService
from halfmoon.telemetry import read_spans, setup_tracing


async def wait_until_up(http: httpx.AsyncClient, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"gateway exited with {proc.returncode}"
        assert time.monotonic() < end, "gateway did not come up"
        try:
            if (await http.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            await asyncio.sleep(0.05)


class TestGatewayProcess:
    async def test_serves_from_flags_and_env_then_stops_on_sigterm(
        self, nats_server, namespace, tiny_model_dir, processes, unused_port
    ):
        env = {"HALFMOON_NAMESPACE": namespace, "HALFMOON_MODEL_NAME": "tiny-env"}
        proc = processes.start(
            [
                "-m",
                "halfmoon.services.gateway",
                "--nats-url",
                nats_server.url,
                "--port",
                str(unused_port),
                "--model-dir",
                str(tiny_model_dir),
            ],
            extra_env=env,
        )
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{unused_port}", timeout=10) as http:
            await wait_until_up(http, proc)
            assert (await http.get("/health")).json() == {"status": "ok"}
            assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["tiny-env"]
            bad = await http.post("/v1/completions", json={"model": "tiny-env", "prompt": "x", "max_tokens": -1})
            assert bad.status_code == 400
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0

    async def test_missing_model_dir_is_a_usage_error(self, processes):
        proc = processes.start(["-m", "halfmoon.services.gateway"], stderr=subprocess.PIPE, text=True)
        assert await asyncio.to_thread(proc.wait, 60) == 2
        assert "model_dir is required" in proc.stderr.read()


class TestOneTraceAcrossServices:
    async def test_gateway_conductor_prefill_spans_share_a_trace(
        self, nats_server, namespace, tiny_model_dir, tmp_path
    ):
        trace_file = str(tmp_path / "trace.jsonl")
        providers = {
            name: setup_tracing(name, f"{name}-0", trace_file=trace_file, env={})
            for name in ("gateway", "conductor", "prefill")
        }
        common = dict(nats_url=nats_server.url, namespace=namespace, heartbeat_interval_s=0.05)
        conductor = ConductorService(ConductorConfig(**common, instance_timeout_s=1.0), providers["conductor"])
        prefill = ScriptedPrefill(ServiceConfig(**common, instance_id="p0"), Script(output=(10, 11, 12)))
        prefill.tracer = providers["prefill"].get_tracer("prefill")
        gateway = GatewayService(
            GatewayConfig(**common, model_dir=str(tiny_model_dir), model_name="tiny", port=0), providers["gateway"]
        )
        hosts = [
            ServiceHost(s) for s in (conductor, prefill, IdleDecode(ServiceConfig(**common, instance_id="d0")), gateway)
        ]
        for host in hosts:
            await host.start()
        try:
            await wait_for(lambda: all(i in conductor.table for i in ("p0", "d0")), "registration")
            async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
                response = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3})
                assert response.status_code == 200
                client_parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
                response = await http.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": "y", "max_tokens": 3},
                    headers={"traceparent": client_parent},
                )
                assert response.status_code == 200
        finally:
            for host in reversed(hosts):
                await host.stop()
            for provider in providers.values():
                provider.shutdown()
        spans = read_spans(trace_file)
        roots = [s for s in spans if s["name"] == "gateway /v1/completions"]
        assert len(roots) == 2
        root = next(s for s in roots if s["parent_id"] is None)
        assert root["service"] == "gateway"
        continued = next(s for s in roots if s["parent_id"] is not None)
        assert (continued["trace_id"], continued["parent_id"]) == ("ab" * 16, "cd" * 8)
        schedule = next(s for s in spans if s["name"] == "conductor.schedule" and s["trace_id"] == root["trace_id"])
        submit = next(s for s in spans if s["name"] == "prefill.submit" and s["trace_id"] == root["trace_id"])
        for child, service in ((schedule, "conductor"), (submit, "prefill")):
            assert child["service"] == service
            assert child["trace_id"] == root["trace_id"] and child["parent_id"] == root["span_id"]
            assert root["start_ns"] <= child["start_ns"] <= child["end_ns"] <= root["end_ns"]
        assert time.time_ns() >= root["end_ns"]
