"""API keys at the gateway: no key or a wrong one gets an OpenAI-style 401; /health stays open."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from halfmoon.deploy.local import LocalCluster
from tests.security.conftest import bearer


def rejections(cluster: LocalCluster, reason: str) -> float:
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "halfmoon_auth_rejections_total" and s.labels.get("reason") == reason)


def assert_401(reply: httpx.Response) -> None:
    assert reply.status_code == 401, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error" and error["message"]
    assert reply.headers["www-authenticate"] == "Bearer"


class TestNoKey:
    @pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
    def test_generation_without_a_key_is_401(self, secure_cluster: LocalCluster, served_model: str, path: str) -> None:
        before = rejections(secure_cluster, "missing_key")
        body = {"model": served_model, "prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        assert_401(httpx.post(f"{secure_cluster.url}{path}", json=body, timeout=30))
        assert rejections(secure_cluster, "missing_key") == before + 1

    def test_models_without_a_key_is_401_but_health_is_open(self, secure_cluster: LocalCluster) -> None:
        assert_401(httpx.get(f"{secure_cluster.url}/v1/models", timeout=10))
        assert httpx.get(f"{secure_cluster.url}/health", timeout=10).status_code == 200

    def test_a_non_bearer_scheme_is_no_key(self, secure_cluster: LocalCluster) -> None:
        assert_401(httpx.get(f"{secure_cluster.url}/v1/models", auth=("user", "sk-a-0123456789abcdef"), timeout=10))


class TestWrongKey:
    def test_unknown_key_is_401_and_counted(self, secure_cluster: LocalCluster, served_model: str) -> None:
        before = rejections(secure_cluster, "invalid_key")
        reply = httpx.post(f"{secure_cluster.url}/v1/completions", headers={"Authorization": "Bearer sk-nope-012345"},
                           json={"model": served_model, "prompt": "x", "max_tokens": 2}, timeout=30)
        assert_401(reply)
        assert rejections(secure_cluster, "invalid_key") == before + 1

    def test_a_valid_key_is_served(self, secure_cluster: LocalCluster, served_model: str) -> None:
        reply = httpx.post(f"{secure_cluster.url}/v1/completions", headers=bearer("tenant-b"),
                           json={"model": served_model, "prompt": "hello", "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200, reply.text
