"""One deployment with security on, shared by the security tests: per-role NATS users (one per gateway:
it runs two, ``gateway-0`` at ``url`` and ``gateway-1``) and API keys for three tenants (``limited`` may
send 2 requests a minute)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from halfmoon.deploy.local import LocalCluster
from tests.e2e.conftest import start_cluster

KEYS = {"tenant-a": "sk-a-0123456789abcdef", "tenant-b": "sk-b-0123456789abcdef", "limited": "sk-l-0123456789abcdef"}
LIMITED_RPM = 2


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="session")
def secure_cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    keys = (f"{KEYS['tenant-a']} tenant-a\n{KEYS['tenant-b']} tenant-b\n"
            f"{KEYS['limited']} limited {LIMITED_RPM} 0   # two requests a minute\n")
    # a short context keeps every generated request (the fuzzer's too) quick on a CPU
    cluster = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("run-secure"), api_keys=keys,
                            env={"HALFMOON_MAX_MODEL_LEN": "160"}, prefill=1, decode=1, gateway=2)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def served_model(secure_cluster: LocalCluster) -> str:
    return httpx.get(f"{secure_cluster.url}/v1/models", headers=bearer("tenant-a"), timeout=10).json()["data"][0]["id"]
