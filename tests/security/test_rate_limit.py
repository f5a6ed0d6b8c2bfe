"""Per-tenant limits hold across gateway replicas: the third request in a minute of a tenant
allowed two gets 429 with Retry-After, whichever replica each request reached."""

from __future__ import annotations

import time

import httpx
import pytest

from halfmoon.deploy.local import LocalCluster
from halfmoon.services.gateway.ratelimit import WINDOW_S
from tests.security.conftest import LIMITED_RPM, bearer


@pytest.fixture
def second_gateway(secure_cluster: LocalCluster) -> str:
    """The deployment's other gateway replica (its own port, its own NATS user)."""
    ready = secure_cluster.read_ready("gateway-1")
    assert ready is not None, "the second gateway is not up"
    return str(ready["address"])


def wait_for_fresh_window(needed_s: float = 20.0) -> None:
    """Start the burst early in a rate window, so all of it falls into one."""
    end = time.monotonic() + WINDOW_S
    while WINDOW_S - time.time() % WINDOW_S < needed_s and time.monotonic() < end:
        time.sleep(0.2)


class TestRateLimitAcrossReplicas:
    def test_third_request_of_the_minute_is_429(self, secure_cluster: LocalCluster, second_gateway: str,
                                                served_model: str) -> None:
        body = {"model": served_model, "prompt": "rate", "max_tokens": 1}
        wait_for_fresh_window()
        urls = [secure_cluster.url, second_gateway, secure_cluster.url, second_gateway]
        replies = [httpx.post(f"{url}/v1/completions", headers=bearer("limited"), json=body, timeout=60)
                   for url in urls]
        assert [r.status_code for r in replies] == [200] * LIMITED_RPM + [429] * (len(urls) - LIMITED_RPM)
        refused = replies[LIMITED_RPM]
        assert 1 <= int(refused.headers["retry-after"]) <= WINDOW_S
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert "limited" in error["message"]
        other = httpx.post(f"{second_gateway}/v1/completions", headers=bearer("tenant-a"), json=body, timeout=60)
        assert other.status_code == 200, other.text
