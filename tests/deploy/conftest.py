"""The deployment files as data: docker-compose.yml, its overrides, the rendered Kubernetes manifests."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
COMPOSE_OVERRIDES = (REPO_ROOT / "infra" / "compose.shm.yml", REPO_ROOT / "infra" / "compose.gpu.yml",
                     REPO_ROOT / "infra" / "compose.vllm.yml")
K8S_BASE = REPO_ROOT / "infra" / "k8s" / "base"
K8S_GPU = REPO_ROOT / "infra" / "k8s" / "overlays" / "gpu"
K8S_PLANNER = REPO_ROOT / "infra" / "k8s" / "overlays" / "planner"
K8S_VLLM = REPO_ROOT / "infra" / "k8s" / "overlays" / "vllm"
K8S_VERSION = "1.37.0"  # the API schemas (kubernetes-validate's) the manifests and requests are checked against
HALFMOON_IMAGE = "${HALFMOON_IMAGE:-halfmoon:latest}"
_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def tool(name: str) -> str:
    """An executable a test-extra wheel installs next to this Python (kubectl, hadolint, ...)."""
    path = Path(sysconfig.get_path("scripts")) / name
    if not path.exists():
        path = Path(sys.executable).parent / name
    if not path.exists():
        raise FileNotFoundError(f"{name} not found: pip install -e '.[test]'")
    return str(path)


def interpolate(value: Any) -> Any:
    """What compose makes of ``${VAR:-default}`` with nothing set in the environment."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="session")
def compose_raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="session")
def compose(compose_raw: dict[str, Any]) -> dict[str, Any]:
    """docker-compose.yml with defaults substituted, as compose runs it with no variables set."""
    return interpolate(compose_raw)


def kustomize(directory: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [tool("kubectl"), "kustomize", str(directory)], check=False, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="session")
def k8s_base() -> list[dict[str, Any]]:
    return kustomize(K8S_BASE)


@pytest.fixture(scope="session")
def k8s_gpu() -> list[dict[str, Any]]:
    return kustomize(K8S_GPU)


@pytest.fixture(scope="session")
def k8s_planner() -> list[dict[str, Any]]:
    return kustomize(K8S_PLANNER)


@pytest.fixture(scope="session")
def k8s_vllm() -> list[dict[str, Any]]:
    return kustomize(K8S_VLLM)


def workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}
