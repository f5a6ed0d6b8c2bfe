"""infra/compose.offline.yml and infra/offline/Dockerfile, statically: with the override, every service
that runs by default is built here (no registry image), from a Dockerfile stage that exists, on the
local base image; the Halfmoon services are unchanged but for where spans go. The real stack is
tests/deploy/test_compose_stack.py."""

from __future__ import annotations

import re
import subprocess
from typing import Any

import yaml

from halfmoon.deploy.topology import SERVICES
from tests.conftest import REPO_ROOT
from tests.deploy.conftest import COMPOSE_FILE, interpolate, tool
from tests.deploy.test_deploy_compose import check_compose_schema

OFFLINE = REPO_ROOT / "infra" / "compose.offline.yml"
OFFLINE_DOCKERFILE = REPO_ROOT / "infra" / "offline" / "Dockerfile"


def merged() -> dict[str, Any]:
    """docker-compose.yml with the override laid over it, service by service (as compose merges
    mappings; lists such as volumes are unioned)."""
    base = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()))
    over = interpolate(yaml.safe_load(OFFLINE.read_text()))
    services = {}
    for name, svc in base["services"].items():
        extra = over["services"].get(name, {})
        out = {**svc, **{k: v for k, v in extra.items() if k not in ("environment", "build", "volumes")}}
        if "environment" in extra:
            out["environment"] = {**(svc.get("environment") or {}), **extra["environment"]}
        if "build" in extra:
            out["build"] = {**(svc.get("build") or {}), **extra["build"],
                            "args": {**(svc.get("build") or {}).get("args", {}), **extra["build"].get("args", {})}}
        if "volumes" in extra:
            out["volumes"] = sorted(set(svc.get("volumes", [])) | set(extra["volumes"]))
        services[name] = out
    return {"services": services, "volumes": {**base["volumes"], **over.get("volumes", {})}}


def stages() -> set[str]:
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", OFFLINE_DOCKERFILE.read_text(), re.M | re.I))


def test_override_validates() -> None:
    result = check_compose_schema(COMPOSE_FILE, OFFLINE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_default_service_is_built_here() -> None:
    compose = merged()
    for name, svc in compose["services"].items():
        if "ui" in svc.get("profiles", []):
            continue
        build = svc.get("build")
        if build is None:  # the bucket job runs the s3 image built for `s3`
            assert any(svc["image"] == other.get("image") and other.get("build")
                       for other in compose["services"].values()), f"{name} needs a registry image"
            continue
        assert build["args"]["BASE_IMAGE"] == "halfmoon-base:bookworm", name
        assert build.get("network") == "host", name
        dockerfile = REPO_ROOT / build["context"] / build["dockerfile"]
        assert dockerfile.exists(), name
        if dockerfile == OFFLINE_DOCKERFILE:
            assert build["target"] in stages(), f"{name}: no stage {build['target']}"
    assert {n for n, s in compose["services"].items() if "ui" in s.get("profiles", [])} == {"jaeger", "grafana"}


def test_halfmoon_services_keep_their_commands_and_write_spans_to_the_volume() -> None:
    compose = merged()
    for spec in SERVICES:
        svc = compose["services"][spec.name]
        assert svc["command"] == spec.command
        assert svc["environment"]["HALFMOON_TRACE_FILE"] == "/traces/spans.jsonl"
        assert "traces:/traces" in svc["volumes"]
    assert "traces" in compose["volumes"]
    assert "nvme:/nvme" in compose["services"]["transfer"]["volumes"]
    for worker in ("prefill", "decode", "gateway"):
        assert "models:/models" in compose["services"][worker]["volumes"]


def test_offline_dockerfile_lints_clean() -> None:
    result = subprocess.run([tool("hadolint"), "--failure-threshold", "warning", str(OFFLINE_DOCKERFILE)],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_scripts_parse() -> None:
    for script in ("infra/make-base-image.sh", "infra/compose-check.sh", "infra/seaweedfs/create-bucket-weed.sh"):
        result = subprocess.run(["bash", "-n", str(REPO_ROOT / script)], check=False, capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"
