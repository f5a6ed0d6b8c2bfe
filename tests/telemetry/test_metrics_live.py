"""Every service's /metrics after real requests through a real deployment (NATS + one process per service)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from halfmoon.deploy.local import LocalCluster
from tests.e2e.conftest import model_name
from tests.telemetry.test_metrics import NAMES

# The engine's local prefix cache is off so that a repeated prompt is served from the pool (the
# cache-manager's lookups count it too); prefill's counters cover both tiers either way.
ENV = {
    "HALFMOON_HEARTBEAT_INTERVAL_S": "0.25",
    "HALFMOON_METRICS_PORT": "-1",
    "OTEL_BSP_SCHEDULE_DELAY": "100",
    "HALFMOON_LOCAL_PREFIX_CACHE": "0",
    "HALFMOON_METRICS_HOST": "127.0.0.1",
}
# long enough for several full 16-token blocks, so a repeat finds a cached prefix
LONG_PROMPT = "the quick brown fox jumps over the lazy dog while the cat watches " * 6
_URL = re.compile(r"metrics on http://[0-9.]+:(\d+)/metrics")


def metrics_port(cluster: LocalCluster, instance_id: str, deadline_s: float = 20.0) -> int:
    """The port an instance started with HALFMOON_METRICS_PORT=-1 chose, from its log."""
    log = cluster.run_dir / "logs" / f"{instance_id}.log"
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if found := _URL.search(log.read_text(errors="replace") if log.exists() else ""):
            return int(found.group(1))
        time.sleep(0.05)
    raise AssertionError(f"{instance_id} never logged its metrics URL")


class Scraper:
    def __init__(self, cluster: LocalCluster) -> None:
        self.ports = {iid: metrics_port(cluster, iid) for _, iid in cluster.plan}

    def families(self, instance_id: str) -> dict[str, list]:
        text = httpx.get(f"http://127.0.0.1:{self.ports[instance_id]}/metrics", timeout=10).text
        return {f.name: f.samples for f in text_string_to_metric_families(text)}

    def value(self, instance_id: str, sample: str, **labels: str) -> float:
        """Sum of ``sample`` over the series matching ``labels`` (0 if none)."""
        family = re.sub(r"_(total|count|sum|bucket)$", "", sample)
        return sum(
            s.value
            for s in self.families(instance_id).get(family, [])
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
        )


def complete(cluster: LocalCluster, prompt: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(
        f"{cluster.url}/v1/completions",
        timeout=60,
        json={"model": model_name(cluster), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        tiny_model_dir, tmp_path_factory.mktemp("run-metrics"), {}, gateway_port=0, namespace="metrics", env=ENV
    )
    cluster.start(timeout=240)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def scraper(cluster: LocalCluster) -> Scraper:
    return Scraper(cluster)


class TestEveryServiceExposesTheNamedMetrics:
    def test_all_families_on_every_instance(self, cluster: LocalCluster, scraper: Scraper) -> None:
        assert set(scraper.ports) == {
            "conductor-0",
            "cache-manager-0",
            "transfer-0",
            "prefill-0",
            "decode-0",
            "gateway-0",
        }
        assert len(set(scraper.ports.values())) == len(scraper.ports)
        for instance_id in scraper.ports:
            assert set(NAMES) <= set(scraper.families(instance_id)), instance_id

    def test_gateway_http_port_serves_them_too(self, cluster: LocalCluster) -> None:
        text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"halfmoon_rejections", "halfmoon_errors", "halfmoon_gateway_requests"} <= names


class TestServingIsCounted:
    def test_ttft_count_equals_requests_served(self, cluster: LocalCluster, scraper: Scraper) -> None:
        before = scraper.value("prefill-0", "halfmoon_ttft_seconds_count", instance="prefill-0")
        for i in range(3):
            assert complete(cluster, f"request number {i} about metrics").status_code == 200
        assert scraper.value("prefill-0", "halfmoon_ttft_seconds_count", instance="prefill-0") == before + 3
        seconds = scraper.value("prefill-0", "halfmoon_ttft_seconds_sum", instance="prefill-0")
        assert 0 < seconds < 60 * (before + 3)
        assert scraper.value("decode-0", "halfmoon_tbt_seconds_count", instance="decode-0") >= 3

    def test_kv_bytes_moved_through_the_data_plane(self, cluster: LocalCluster, scraper: Scraper) -> None:
        assert complete(cluster, "move my KV please " * 4).status_code == 200
        written = scraper.value("prefill-0", "halfmoon_transfer_bytes_total", direction="write")
        read = scraper.value("decode-0", "halfmoon_transfer_bytes_total", direction="read")
        assert written > 0 and read > 0
        # same host: the shared-memory transport moves the DRAM blocks
        assert scraper.value("prefill-0", "halfmoon_transfer_bytes_total", transport="shm", direction="write") > 0
        assert scraper.value("cache-manager-0", "halfmoon_pool_bytes", node="transfer-0", tier="dram") > 0

    def test_load_gauges_carry_the_role(self, scraper: Scraper) -> None:
        queue = [s for s in scraper.families("prefill-0")["halfmoon_queue_length"] if s.labels == {"role": "prefill"}]
        running = [
            s for s in scraper.families("decode-0")["halfmoon_running_requests"] if s.labels == {"role": "decode"}
        ]
        assert len(queue) == 1 and queue[0].value >= 0
        assert len(running) == 1 and running[0].value >= 0


class TestCacheHitsAreCounted:
    def test_repeating_a_long_prompt_hits_the_pool(self, cluster: LocalCluster, scraper: Scraper) -> None:
        def counts(instance_id: str) -> tuple[float, float]:
            return (
                scraper.value(instance_id, "halfmoon_cache_hit_blocks_total"),
                scraper.value(instance_id, "halfmoon_cache_miss_blocks_total"),
            )

        hits0, misses0 = counts("prefill-0")
        assert complete(cluster, LONG_PROMPT).status_code == 200
        hits1, misses1 = counts("prefill-0")
        assert hits1 == hits0 and misses1 > misses0  # first time: nothing cached
        manager_hits1, _ = counts("cache-manager-0")
        assert complete(cluster, LONG_PROMPT).status_code == 200
        hits2, misses2 = counts("prefill-0")
        assert hits2 - hits1 == misses1 - misses0  # every reusable block now comes from the pool
        assert misses2 == misses1
        assert counts("cache-manager-0")[0] >= manager_hits1 + (hits2 - hits1)


@pytest.fixture(scope="module")
def no_prefill(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        tiny_model_dir,
        tmp_path_factory.mktemp("run-no-prefill"),
        {"prefill": 0, "decode": 0, "transfer": 0},
        gateway_port=0,
        namespace="noprefill",
        env={**ENV, "HALFMOON_INSTANCE_WAIT_S": "0"},  # the 429 at once, not after waiting for a prefill
    )
    cluster.start(timeout=240)
    yield cluster
    cluster.stop()


class TestRejectionsAreCounted:
    def test_a_429_counts_its_reason(self, no_prefill: LocalCluster) -> None:
        scraper = Scraper(no_prefill)
        before = scraper.value("gateway-0", "halfmoon_rejections_total", reason="no_prefill_instance")
        reply = complete(no_prefill, "nobody will prefill this")
        assert reply.status_code == 429
        assert scraper.value("gateway-0", "halfmoon_rejections_total", reason="no_prefill_instance") == before + 1
        gateway_port_text = httpx.get(f"{no_prefill.url}/metrics", timeout=10).text
        assert 'halfmoon_rejections_total{reason="no_prefill_instance"} 1.0' in gateway_port_text
