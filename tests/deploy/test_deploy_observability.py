"""Prometheus scrapes every service wherever compose runs it; the Grafana dashboard shows the
named metrics, and only series the services really export."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from halfmoon.deploy.topology import SERVICES
from halfmoon.services.gateway.metrics import GatewayMetrics
from halfmoon.telemetry.metrics import Metrics
from tests.conftest import REPO_ROOT
from tests.deploy.conftest import env_of

INFRA = REPO_ROOT / "infra"
DASHBOARD = INFRA / "grafana" / "dashboards" / "halfmoon.json"
REQUIRED = (
    "halfmoon_ttft_seconds",
    "halfmoon_tbt_seconds",
    "halfmoon_queue_length",
    "halfmoon_running_requests",
    "halfmoon_cache_hit_blocks_total",
    "halfmoon_cache_miss_blocks_total",
    "halfmoon_pool_bytes",
    "halfmoon_transfer_bytes_total",
    "halfmoon_rejections_total",
    "halfmoon_errors_total",
    "halfmoon_gateway_requests_total",
    "halfmoon_gateway_in_flight",
    "halfmoon_gateway_ttft_seconds",
    "halfmoon_gateway_inter_token_seconds",
    "halfmoon_gateway_prompt_tokens_total",
    "halfmoon_gateway_cached_prompt_tokens_total",
    "halfmoon_gateway_completion_tokens_total",
)
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_series() -> set[str]:
    """Every series name the services' real registries can expose."""
    names = set()
    for registry in (Metrics().registry, GatewayMetrics().registry):
        for family in registry.collect():
            names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    return names


def panels() -> list[dict[str, Any]]:
    return json.loads(DASHBOARD.read_text())["panels"]


def dashboard_series() -> set[str]:
    exprs = " ".join(t["expr"] for p in panels() for t in p["targets"])
    return set(re.findall(r"\bhalfmoon_[a-z_]+", exprs))


class TestPrometheusScrapes:
    def test_every_service_is_discovered_by_its_compose_name(self, compose: dict[str, Any]) -> None:
        config = yaml.safe_load((INFRA / "prometheus.yml").read_text())
        scraped = set()
        for job in config["scrape_configs"]:
            for sd in job["dns_sd_configs"]:
                assert sd["type"] == "A", "one target per replica"
                scraped.update((name, sd["port"]) for name in sd["names"])
        for spec in SERVICES:
            env = env_of(compose["services"][spec.name])
            # The gateway's API port serves its HTTP metrics and the process-wide ones together.
            port = env["HALFMOON_PORT"] if spec.name == "gateway" else env["HALFMOON_METRICS_PORT"]
            assert (spec.name, int(port)) in scraped
        assert ("gateway", int(env_of(compose["services"]["gateway"])["HALFMOON_METRICS_PORT"])) not in scraped

    def test_compose_mounts_the_config_prometheus_reads(self, compose: dict[str, Any]) -> None:
        prometheus = compose["services"]["prometheus"]
        assert "./infra/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
        assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


class TestDashboard:
    def test_shows_every_named_metric(self) -> None:
        shown = dashboard_series()
        assert [name for name in REQUIRED if name not in shown and name + "_bucket" not in shown] == []

    def test_reads_only_series_the_services_export(self) -> None:
        assert dashboard_series() - exported_series() == set()

    def test_panels_use_the_provisioned_datasource(self) -> None:
        provisioned = yaml.safe_load((INFRA / "grafana/provisioning/datasources/datasources.yml").read_text())
        uids = {d["uid"] for d in provisioned["datasources"] if d["type"] == "prometheus"}
        ids = [p["id"] for p in panels()]
        assert len(ids) == len(set(ids))
        for panel in panels():
            assert panel["datasource"]["uid"] in uids
            assert all(t["datasource"]["uid"] in uids for t in panel["targets"])

    def test_grafana_loads_it_from_where_compose_mounts_it(self, compose: dict[str, Any]) -> None:
        provider = yaml.safe_load((INFRA / "grafana/provisioning/dashboards/dashboards.yml").read_text())
        path = provider["providers"][0]["options"]["path"]
        assert f"./infra/grafana/dashboards:{path}:ro" in compose["services"]["grafana"]["volumes"]
