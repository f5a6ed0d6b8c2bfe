"""Per-tenant limits hold across gateway replicas: the third request in a minute of a tenant
allowed two gets 429 with Retry-After, whichever replica each request reached."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from halfmoon.deploy.local import LocalCluster, free_port
from halfmoon.deploy.topology import SERVICES
from halfmoon.services.gateway.ratelimit import WINDOW_S
from tests.conftest import Processes
from tests.security.conftest import LIMITED_RPM, bearer


@pytest.fixture
def second_gateway(secure_cluster: LocalCluster, processes: Processes) -> Iterator[str]:
    """Another gateway replica of the same deployment, on its own port."""
    spec = next(s for s in SERVICES if s.name == "gateway")
    port = free_port()
    env = {k: v for k, v in secure_cluster.env_for(spec, "gateway-9").items() if k.startswith("HALFMOON_")}
    proc = processes.start(["-m", spec.module], extra_env={**env, "HALFMOON_PORT": str(port)})
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 120
    while True:
        assert proc.poll() is None, "second gateway exited"
        assert time.monotonic() < end, "second gateway not up"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # polling a port with a deadline
    yield url


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
