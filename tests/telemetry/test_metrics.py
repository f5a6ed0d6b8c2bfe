"""The metrics registry and its /metrics endpoint, in process."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from halfmoon.runtime.config import ServiceConfig, load_config
from halfmoon.telemetry.metrics import Metrics, MetricsEndpoint

NAMES = (
    "halfmoon_ttft_seconds",
    "halfmoon_tbt_seconds",
    "halfmoon_queue_length",
    "halfmoon_running_requests",
    "halfmoon_cache_hit_blocks",
    "halfmoon_cache_miss_blocks",
    "halfmoon_pool_bytes",
    "halfmoon_transfer_bytes",
    "halfmoon_rejections",
    "halfmoon_errors",
    "halfmoon_auth_rejections",
    "halfmoon_ttft_prediction_error_ratio",
    "halfmoon_tbt_prediction_error_ratio",
)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class TestRegistry:
    def test_every_named_family_is_exposed_before_anything_is_recorded(self) -> None:
        text = Metrics().render().decode()
        families = {f.name for f in text_string_to_metric_families(text)}
        assert set(NAMES) <= families
        assert samples(text)[("process_resident_memory_bytes", frozenset())] > 0

    def test_recordings_show_up_with_their_labels(self) -> None:
        metrics = Metrics()
        metrics.transfer_bytes.labels("shm", "read").inc(4096)
        metrics.rejections.labels("no_prefill_instance").inc()
        metrics.ttft.labels("prefill-0").observe(0.03)
        got = samples(metrics.render().decode())
        assert got[("halfmoon_transfer_bytes_total", frozenset({("transport", "shm"), ("direction", "read")}))] == 4096
        assert got[("halfmoon_rejections_total", frozenset({("reason", "no_prefill_instance")}))] == 1
        assert got[("halfmoon_ttft_seconds_count", frozenset({("instance", "prefill-0")}))] == 1
        assert got[("halfmoon_ttft_seconds_bucket", frozenset({("instance", "prefill-0"), ("le", "0.025")}))] == 0
        assert got[("halfmoon_ttft_seconds_bucket", frozenset({("instance", "prefill-0"), ("le", "0.05")}))] == 1


class TestScrapeSources:
    def test_sources_run_at_render_until_unregistered(self) -> None:
        metrics = Metrics()
        depth = [3]
        unregister = metrics.on_scrape(lambda m: m.queue_length.labels("prefill").set(depth[0]))
        assert samples(metrics.render().decode())[("halfmoon_queue_length", frozenset({("role", "prefill")}))] == 3
        depth[0] = 5
        assert samples(metrics.render().decode())[("halfmoon_queue_length", frozenset({("role", "prefill")}))] == 5
        unregister()
        depth[0] = 7
        assert samples(metrics.render().decode())[("halfmoon_queue_length", frozenset({("role", "prefill")}))] == 5

    def test_a_failing_source_is_counted_and_the_rest_still_render(self) -> None:
        metrics = Metrics()

        def broken(_m: Metrics) -> None:
            raise KeyError("gone")

        metrics.on_scrape(broken)
        metrics.on_scrape(lambda m: m.running_requests.labels("decode").set(2))
        got = samples(metrics.render().decode())
        assert got[("halfmoon_errors_total", frozenset({("kind", "metrics_source")}))] == 1
        assert got[("halfmoon_running_requests", frozenset({("role", "decode")}))] == 2


class TestEndpoint:
    async def test_serves_prometheus_text_on_a_free_port(self) -> None:
        metrics = Metrics()
        metrics.errors.labels("timeout").inc(2)
        endpoint = MetricsEndpoint(metrics, "127.0.0.1", 0)
        await endpoint.start()
        try:
            assert endpoint.port > 0
            async with httpx.AsyncClient() as client:
                reply = await client.get(f"http://127.0.0.1:{endpoint.port}/metrics")
                missing = await client.get(f"http://127.0.0.1:{endpoint.port}/other")
            assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
            assert samples(reply.text)[("halfmoon_errors_total", frozenset({("kind", "timeout")}))] == 2
            assert missing.status_code == 404
        finally:
            await endpoint.stop()

    async def test_a_scraper_that_hangs_up_does_not_stop_the_endpoint(self) -> None:
        endpoint = MetricsEndpoint(Metrics(), "127.0.0.1", 0)
        await endpoint.start()
        try:
            _reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
            writer.write(b"GET /met")
            writer.close()
            async with httpx.AsyncClient() as client:
                assert (await client.get(f"http://127.0.0.1:{endpoint.port}/metrics")).status_code == 200
        finally:
            await endpoint.stop()


class TestPortInUse:
    async def test_a_taken_port_is_a_clear_error(self) -> None:
        first = MetricsEndpoint(Metrics(), "127.0.0.1", 0)
        await first.start()
        try:
            with pytest.raises(OSError, match=f"cannot serve /metrics on 127.0.0.1:{first.port}"):
                await MetricsEndpoint(Metrics(), "127.0.0.1", first.port).start()
        finally:
            await first.stop()


class TestMetricsPortSetting:
    def test_default_is_off_and_minus_one_means_any_port(self) -> None:
        assert ServiceConfig().metrics_port == 0
        assert load_config(ServiceConfig, [], env={"HALFMOON_METRICS_PORT": "-1"}).metrics_port == -1
        assert load_config(ServiceConfig, ["--metrics-port", "9100"], env={}).metrics_port == 9100

    @pytest.mark.parametrize("port", [-2, 65536])
    def test_out_of_range_is_refused(self, port: int) -> None:
        with pytest.raises(ValueError, match="metrics_port"):
            ServiceConfig(metrics_port=port)
