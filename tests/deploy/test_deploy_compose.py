"""docker-compose.yml: valid by the compose specification, the same services and commands as
`halfmoon up`, safe to scale, healthy only when serving. (No Docker engine here: see docs/DEPLOY.md.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from halfmoon.deploy.nats_auth import ROLE_USERS
from halfmoon.deploy.topology import SERVICES
from halfmoon.protocol.permissions import PLANNER
from halfmoon.runtime import ServiceConfig
from tests.conftest import REPO_ROOT, free_port, service_env
from tests.deploy.conftest import (
    COMPOSE_FILE,
    COMPOSE_OVERRIDES,
    HALFMOON_IMAGE,
    env_of,
    interpolate,
    tool,
)
from tests.deploy.test_deploy_entrypoint import role_of

SCALE = {"prefill": 2, "decode": 3, "transfer": 2, "gateway": 3}
# read by infra/entrypoint.py: turned into HALFMOON_NVME_DIR, and into this role's (or gateway slot's) credentials
ENTRYPOINT_ONLY = {"HALFMOON_NVME_ROOT", "HALFMOON_SECRETS_DIR", "HALFMOON_SECRETS_ROLE", "HALFMOON_GATEWAY_SLOTS"}
JOBS = {"models": "test", "secrets": "halfmoon", "jetstream": "halfmoon"}  # one-shot jobs on the Halfmoon image, and what they run
OPTIONAL = {"planner": ["python", "-m", "halfmoon.services.planner"]}  # services a compose profile of their name turns on


def check_compose_schema(*files: Path) -> subprocess.CompletedProcess[str]:
    args = [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", *map(str, files)]
    return subprocess.run(args, check=False, capture_output=True, text=True, timeout=60)


def halfmoon_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run the Halfmoon image (every one of them, since all build it the same way)."""
    image = interpolate(HALFMOON_IMAGE)
    return {name: svc for name, svc in compose["services"].items() if svc.get("image") == image}


class TestComposeSchema:
    def test_compose_file_and_overrides_validate(self) -> None:
        result = check_compose_schema(COMPOSE_FILE, *COMPOSE_OVERRIDES)
        assert result.returncode == 0, result.stdout + result.stderr

    def test_validator_rejects_a_broken_file(self, compose_raw: dict[str, Any], tmp_path: Path) -> None:
        broken = dict(compose_raw, services=dict(compose_raw["services"]))
        broken["services"]["gateway"] = dict(broken["services"]["gateway"], portz=["8000:8000"])
        path = tmp_path / "docker-compose.yml"
        path.write_text(yaml.safe_dump(broken))
        result = check_compose_schema(path)
        assert result.returncode != 0 and "portz" in result.stdout + result.stderr


class TestSameServicesAsHalfmoonUp:
    def test_every_topology_service_runs_its_command(self, compose: dict[str, Any]) -> None:
        for spec in SERVICES:
            assert spec.name in compose["services"], f"{spec.name} missing from docker-compose.yml"
            assert compose["services"][spec.name]["command"] == spec.command

    def test_nothing_else_runs_halfmoon_code(self, compose: dict[str, Any]) -> None:
        topology = {spec.name for spec in SERVICES}
        jobs = set(halfmoon_services(compose)) - topology - set(OPTIONAL)
        assert jobs == set(JOBS), "one-shot jobs on the Halfmoon image"
        for name in jobs:
            svc = compose["services"][name]
            assert svc["command"][0] == JOBS[name], f"{name} runs {svc['command']}"
            assert svc["restart"] == "no", f"{name} is a one-shot job, it must not restart"
        runs_python = {
            n for n, s in compose["services"].items() if str((s.get("command") or [""])[0]).startswith("python")
        }
        assert runs_python == topology | set(OPTIONAL)

    def test_optional_services_run_only_under_their_profile(self, compose: dict[str, Any]) -> None:
        for name, svc in compose["services"].items():
            assert svc.get("profiles", []) == ([name] if name in OPTIONAL else []), name
            if name in OPTIONAL:
                assert svc["command"] == OPTIONAL[name]

    def test_one_image_built_from_infra(self, compose: dict[str, Any]) -> None:
        builds = {str(svc["build"]) for svc in halfmoon_services(compose).values()}
        assert len(builds) == 1
        build = next(iter(halfmoon_services(compose).values()))["build"]
        assert (REPO_ROOT / build["context"] / build["dockerfile"]).resolve() == REPO_ROOT / "infra" / "Dockerfile"


class TestModulesStart:
    """Every compose module exists and parses its configuration; each HALFMOON_* variable compose
    sets is one the service reads (a typo would otherwise be silently ignored)."""

    def test_help_exits_zero_and_knows_every_variable(self, compose: dict[str, Any]) -> None:
        topology = {spec.name for spec in SERVICES} | set(OPTIONAL)
        procs = {
            name: subprocess.Popen(
                [sys.executable, *svc["command"][1:], "--help"],
                cwd=REPO_ROOT,
                env=service_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name, svc in compose["services"].items()
            if name in topology
        }
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{name}: {err[-2000:]}"
            out = " ".join(out.split())  # argparse wraps help lines
            for var in env_of(compose["services"][name]):
                if var.startswith("HALFMOON_") and var not in ENTRYPOINT_ONLY:
                    assert f"env {var})" in out, f"{name} does not read {var}"


class TestScaling:
    def test_scaled_services_publish_no_host_port_and_set_no_instance_id(self, compose: dict[str, Any]) -> None:
        for spec in SERVICES:
            svc = compose["services"][spec.name]
            if spec.scalable:
                assert not svc.get("ports"), f"{spec.name} is scalable but publishes {svc['ports']}"
                assert "container_name" not in svc and "hostname" not in svc
                assert "HALFMOON_INSTANCE_ID" not in env_of(svc)

    def test_no_host_port_clash_when_scaled(self, compose: dict[str, Any]) -> None:
        published: Counter[str] = Counter()
        for name, svc in compose["services"].items():
            for _replica in range(SCALE.get(name, 1)):
                for port in svc.get("ports", []):
                    host = str(port["published"]) if isinstance(port, dict) else str(port).rsplit(":", 1)[0]
                    published[host] += 1
        assert published, "the gateway and the UIs publish ports"
        assert [p for p, n in published.items() if n > 1] == []

    def test_transfer_replicas_get_their_own_address_and_nvme_slot(self, compose: dict[str, Any]) -> None:
        env = env_of(compose["services"]["transfer"])
        assert env["HALFMOON_HOST"] == "0.0.0.0" and "HALFMOON_ADVERTISE_HOST" not in env  # entrypoint sets it
        assert "HALFMOON_NVME_DIR" not in env
        volume = next(
            v for v in compose["services"]["transfer"]["volumes"] if v.split(":")[1] == env["HALFMOON_NVME_ROOT"]
        )
        assert volume.split(":")[0] in compose["volumes"], "the NVMe tier is a named volume"

    def test_dram_segment_fits_in_dev_shm(self, compose: dict[str, Any]) -> None:
        svc = compose["services"]["transfer"]
        units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
        shm = int(svc["shm_size"][:-1]) * units[svc["shm_size"][-1].lower()]
        assert shm >= int(env_of(svc)["HALFMOON_DRAM_BYTES"])


class TestHealthchecks:
    def test_every_long_running_service_has_one(self, compose: dict[str, Any]) -> None:
        for spec in SERVICES:
            check = compose["services"][spec.name]["healthcheck"]
            assert check["test"][0] == "CMD" and not check.get("disable")

    def test_gateway_checks_its_own_port_for_readiness(self, compose: dict[str, Any]) -> None:
        gateway = compose["services"]["gateway"]
        assert f"127.0.0.1:{env_of(gateway)['HALFMOON_PORT']}/ready" in " ".join(gateway["healthcheck"]["test"])

    def test_metrics_check_follows_a_real_service(
        self, compose: dict[str, Any], nats_server, processes, namespace: str
    ) -> None:
        port = str(free_port())
        probe = compose["services"]["conductor"]["healthcheck"]["test"][1:]
        check_env = {**os.environ, "HALFMOON_METRICS_PORT": port}

        def healthy() -> bool:
            return subprocess.run(probe, env=check_env, check=False, capture_output=True, timeout=30).returncode == 0

        assert not healthy(), "nothing is running yet"
        proc = processes.start(
            ["-m", "halfmoon.services.conductor"],
            {"HALFMOON_NATS_URL": nats_server.url, "HALFMOON_NAMESPACE": namespace, "HALFMOON_METRICS_PORT": port},
        )
        deadline = time.monotonic() + 60
        while not healthy():
            assert proc.poll() is None, "the conductor exited"
            assert time.monotonic() < deadline, "never became healthy"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=40)
        assert not healthy(), "a stopped service must not look healthy"


class TestOptIns:
    def test_shared_memory_only_with_the_override(self, compose: dict[str, Any]) -> None:
        assert all("ipc" not in svc and "hostname" not in svc for svc in compose["services"].values()), "TCP by default"
        override = yaml.safe_load(COMPOSE_OVERRIDES[0].read_text())["services"]
        assert override["transfer"]["ipc"] == "shareable"
        for worker in ("prefill", "decode"):
            assert override[worker]["ipc"] == "service:transfer"
            assert override[worker]["hostname"] == override["transfer"]["hostname"], "same host identity"

    def test_gpus_only_with_the_override(self, compose: dict[str, Any]) -> None:
        assert all("deploy" not in svc for svc in compose["services"].values())
        override = yaml.safe_load(COMPOSE_OVERRIDES[1].read_text())["services"]
        assert set(override) == {"prefill", "decode"}
        for worker in override.values():
            (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
            assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
            assert worker["environment"]["HALFMOON_DEVICE"] == "cuda"

    def test_vllm_engines_only_with_the_override_and_an_image_built_with_vllm(self, compose: dict[str, Any]) -> None:
        assert all("HALFMOON_ENGINE" not in env_of(svc) for svc in compose["services"].values()), "Halfmoon's engine"
        assert all("shm_size" not in compose["services"][worker] for worker in ("prefill", "decode"))
        override = yaml.safe_load(COMPOSE_OVERRIDES[2].read_text())["services"]
        assert set(override) == {"prefill", "decode", "gateway"}
        assert set(override["gateway"]) == {"healthcheck"}, "the gateway waits longer for ready engines, and that is all"
        for worker in (override["prefill"], override["decode"]):
            assert worker["environment"]["HALFMOON_ENGINE"] == "vllm"
            assert worker["shm_size"] == "1gb", "vLLM's processes talk through /dev/shm (64 MB by default)"
        # the image's extras come from one build argument, empty unless asked, naming a pyproject extra
        for svc in halfmoon_services(compose).values():
            assert interpolate(svc["build"]["args"]["HALFMOON_EXTRAS"]) == ""
        extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        assert any(requirement.startswith("vllm") for requirement in extras["vllm"])


class TestSecrets:
    """No credential in the compose file: the `secrets` job generates them into a volume on the first
    `up`, NATS and S3 read their configs from it, each service its own role's part."""

    def test_no_literal_credential_anywhere(self, compose_raw: dict[str, Any]) -> None:
        text = COMPOSE_FILE.read_text()
        for word in ("PASSWORD", "SECRET_KEY", "ACCESS_KEY", "INSECURE"):
            for line in text.splitlines():
                if word in line and ":-" in line:
                    assert line.split(":-", 1)[1].startswith("}"), f"a default credential: {line.strip()}"
        assert "HALFMOON_INSECURE_NO_AUTH" not in text

    def test_every_service_connects_as_its_own_role_after_the_job(self, compose: dict[str, Any]) -> None:
        for spec in SERVICES:
            svc = compose["services"][spec.name]
            env = svc["environment"]
            assert env["HALFMOON_SECRETS_DIR"] == "/secrets" and "HALFMOON_SECRETS_ROLE" not in env
            assert role_of(svc["command"]) == spec.name, "the entrypoint names the role after the command"
            assert "secrets:/secrets:ro" in svc["volumes"], f"{spec.name} does not mount the secrets read-only"
        for infra in ("nats", "s3"):
            needs = compose["services"][infra]["depends_on"]["secrets"]
            assert needs["condition"] == "service_completed_successfully"
        assert "/secrets/nats-server.conf" in compose["services"]["nats"]["command"]
        assert "-s3.config=/secrets/s3.json" in compose["services"]["s3"]["command"]
        planner = compose["services"]["planner"]
        assert role_of(planner["command"]) == PLANNER and PLANNER in ROLE_USERS, "`halfmoon secrets` writes planner.env"
        assert "secrets:/secrets:ro" in planner["volumes"] and "HALFMOON_SECRETS_ROLE" not in planner["environment"]
        job = compose["services"]["secrets"]
        assert "--if-missing" in job["command"] and job["volumes"] == ["secrets:/secrets"]


def seconds(duration: str) -> float:
    return float(duration.removesuffix("s"))


class TestPlanner:
    """The optional planner sizes the engine services of its own project through the Docker socket, and
    gives a replica it drains the time compose gives it."""

    def test_it_reaches_the_docker_api_and_names_no_project(self, compose: dict[str, Any]) -> None:
        planner = compose["services"]["planner"]
        env = env_of(planner)
        assert env["HALFMOON_ACTUATOR"] == "docker" and "HALFMOON_COMPOSE_PROJECT" not in env  # its own project's
        assert "/var/run/docker.sock:/var/run/docker.sock" in planner["volumes"]
        assert planner["user"] == "root", "the socket is root's (root on the host either way)"
        assert planner["depends_on"]["nats"]["condition"] == "service_healthy"
        assert {"prefill", "decode"} <= set(planner["depends_on"]), "it starts with the engines it sizes running"

    def test_a_drained_replica_gets_compose_s_grace_period_and_the_planner_waits_for_it(
            self, compose: dict[str, Any]) -> None:
        planner = compose["services"]["planner"]
        env = env_of(planner)
        for engine in ("prefill", "decode"):
            svc = compose["services"][engine]
            assert seconds(svc["stop_grace_period"]) == float(env["HALFMOON_ENGINE_STOP_TIMEOUT_S"])
            drain = float(env_of(svc).get("HALFMOON_DRAIN_TIMEOUT_S", ServiceConfig.drain_timeout_s))
            assert float(env["HALFMOON_ENGINE_STOP_TIMEOUT_S"]) > drain, "SIGKILL before the engine's own drain ends"
        assert float(env["HALFMOON_ENGINE_STOP_TIMEOUT_S"]) < float(env["HALFMOON_DRAIN_TIMEOUT_S"])
        assert seconds(planner["stop_grace_period"]) > float(env["HALFMOON_DRAIN_TIMEOUT_S"])
