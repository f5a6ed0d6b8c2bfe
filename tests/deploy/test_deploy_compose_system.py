"""docker-compose.yml's Halfmoon services, run here as plain processes: each with its compose command
through infra/entrypoint.py and its compose environment, only the container addresses mapped to
loopback ones (there is no Docker engine). Two transfer replicas share one NVMe root, as
`--scale transfer=2` makes them, and two gateway replicas one slots directory. As compose does, the
`secrets` job's command writes the credentials first and NATS runs with its config (a user per role, and
one per gateway slot). They must all pass their compose health checks and serve a completion with the
generated API key, through each gateway."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest

from halfmoon.deploy.processes import nats_server_binary, wait_for_port
from halfmoon.deploy.topology import SERVICES
from tests.conftest import REPO_ROOT, free_port, service_env
from tests.deploy.conftest import env_of
from tests.fixtures.s3 import S3Server, s3_server  # noqa: F401  (fixture)

ENTRYPOINT = REPO_ROOT / "infra" / "entrypoint.py"
REPLICAS = {"transfer": 2, "gateway": 2}
START_TIMEOUT_S = 180.0


class Instance:
    def __init__(
        self, name: str, proc: subprocess.Popen[bytes], env: dict[str, str], health: list[str], log: Path
    ) -> None:
        self.name, self.proc, self.env, self.health, self.log = name, proc, env, health, log

    def healthy(self) -> bool:
        return subprocess.run(self.health, env=self.env, check=False, capture_output=True, timeout=30).returncode == 0

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def distinct_port(taken: set[int]) -> int:
    """A free port no other process of this system was given: a port released by ``free_port`` can be
    handed out again, and two services on one port left one of them dead while the other answered its
    health check (seen once in CI: prefill failed to bind, decode's /health answered for it)."""
    while (port := free_port()) in taken:
        pass
    taken.add(port)
    return port


def local_env(
    compose_env: dict[str, str], nats_url: str, s3_url: str, namespace: str, model_dir: Path, nvme_root: Path,
    secrets: Path, taken: set[int], gateway_slots: Path,
) -> dict[str, str]:
    """The service's compose environment with container names and ports replaced by loopback ones."""
    env = dict(compose_env)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)  # no Jaeger here
    assert env["HALFMOON_NATS_URL"] == "nats://nats:4222"
    assert env["HALFMOON_METRICS_HOST"] == "0.0.0.0"
    env.update(HALFMOON_NATS_URL=nats_url, HALFMOON_NAMESPACE=namespace, HALFMOON_METRICS_PORT=str(distinct_port(taken)),
               HALFMOON_METRICS_HOST="127.0.0.1")  # loopback only on this machine
    assert env["HALFMOON_SECRETS_DIR"] == "/secrets"
    env["HALFMOON_SECRETS_DIR"] = str(secrets)
    if "HALFMOON_MODEL_DIR" in env:
        env["HALFMOON_MODEL_DIR"] = str(model_dir)
    if "HALFMOON_S3_ENDPOINT" in env:
        assert env["HALFMOON_S3_ENDPOINT"] == "http://s3:8333"
        env["HALFMOON_S3_ENDPOINT"] = s3_url
    if "HALFMOON_NVME_ROOT" in env:
        env["HALFMOON_NVME_ROOT"] = str(nvme_root)
    if "HALFMOON_GATEWAY_SLOTS" in env:
        env["HALFMOON_GATEWAY_SLOTS"] = str(gateway_slots)
    if "HALFMOON_HOST" in env:
        assert env["HALFMOON_HOST"] == "0.0.0.0"
        env.update(HALFMOON_HOST="127.0.0.1", HALFMOON_PORT=str(distinct_port(taken)))  # loopback only on this machine
    return env


@pytest.fixture
def secured_nats(compose: dict[str, Any], namespace: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(NATS URL, secrets directory): the `secrets` job's command, then NATS on the config it wrote."""
    job, port, secrets = compose["services"]["secrets"]["command"], free_port(), tmp_path / "secrets"
    assert job[:2] == ["halfmoon", "secrets"]
    subprocess.run([sys.executable, "-m", "halfmoon.cli.main", "secrets", str(secrets), *job[3:], "--namespace",
                    namespace, "--nats-host", "127.0.0.1", "--nats-port", str(port), "--store-dir",
                    str(tmp_path / "jetstream"), "--monitor-port", "0"], check=True, env=service_env(), timeout=60)
    proc = subprocess.Popen([nats_server_binary(), "-c", str(secrets / "nats-server.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, 15, proc)
        # the `jetstream` job's command: the key-value buckets, made by the admin user before any service starts
        job = compose["services"]["jetstream"]["command"]
        assert job[:2] == ["halfmoon", "jetstream"]
        mapped = {"nats://nats:4222": f"nats://127.0.0.1:{port}",
                  "/secrets/nats-credentials.json": str(secrets / "nats-credentials.json")}
        subprocess.run([sys.executable, "-m", "halfmoon.cli.main", *(mapped.get(a, a) for a in job[1:])],
                       check=True, env=service_env(), timeout=60)
        yield f"nats://127.0.0.1:{port}", secrets
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def compose_system(
    compose: dict[str, Any],
    secured_nats: tuple[str, Path],
    s3_server: S3Server,
    namespace: str,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> Iterator[dict[str, list[Instance]]]:
    nats_url, secrets = secured_nats
    keys = dict(line.split("=", 1) for line in (secrets / "s3.env").read_text().split())
    boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
    ).create_bucket(Bucket=env_of(compose["services"]["transfer"])["HALFMOON_S3_BUCKET"])  # the s3-bucket job
    system: dict[str, list[Instance]] = {}
    taken: set[int] = set()
    try:
        for spec in SERVICES:
            svc = compose["services"][spec.name]
            for replica in range(REPLICAS.get(spec.name, 1)):
                env = local_env(env_of(svc), nats_url, s3_server.endpoint_url, namespace, tiny_model_dir,
                                tmp_path / "nvme", secrets, taken, tmp_path / "gateway-slots")
                health = [sys.executable if a == "python" else a for a in svc["healthcheck"]["test"][1:]]
                if spec.name == "gateway":
                    health = [a.replace("127.0.0.1:8000/", f"127.0.0.1:{env['HALFMOON_PORT']}/") for a in health]
                assert svc["command"][0] == "python"
                log = tmp_path / f"{spec.name}-{replica}.log"
                with open(log, "wb") as out:
                    proc = subprocess.Popen(
                        [sys.executable, str(ENTRYPOINT), sys.executable, *svc["command"][1:]],
                        cwd=REPO_ROOT,
                        env={**service_env(), **env},
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                system.setdefault(spec.name, []).append(Instance(spec.name, proc, {**os.environ, **env}, health, log))
        yield system
    finally:
        instances = [i for group in system.values() for i in group]
        for instance in instances:
            if instance.proc.poll() is None:
                instance.proc.send_signal(signal.SIGTERM)
        for instance in instances:
            try:
                instance.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                instance.proc.kill()
                instance.proc.wait()


class TestComposeServicesRunAsConfigured:
    def test_all_pass_their_health_checks_and_serve_a_completion(
        self, compose_system: dict[str, list[Instance]]
    ) -> None:
        pending = [i for group in compose_system.values() for i in group]
        deadline = time.monotonic() + START_TIMEOUT_S
        while pending:
            for instance in pending:
                assert instance.proc.poll() is None, f"{instance.name} exited:\n{instance.log_tail()}"
            assert time.monotonic() < deadline, f"never healthy: {[i.name for i in pending]}"
            pending = [i for i in pending if not i.healthy()]

        nvme_root = Path(compose_system["transfer"][0].env["HALFMOON_NVME_ROOT"])
        assert sorted(p.name for p in nvme_root.iterdir() if p.is_dir()) == ["slot-0", "slot-1"]

        slots = Path(compose_system["gateway"][0].env["HALFMOON_GATEWAY_SLOTS"])
        assert sorted(p.name for p in slots.iterdir()) == ["slot-0.lock", "slot-1.lock"], "one slot per gateway"
        keys = Path(compose_system["gateway"][0].env["HALFMOON_SECRETS_DIR"]) / "api-keys"
        key = next(line.split()[0] for line in keys.read_text().splitlines() if not line.startswith("#"))
        for instance in compose_system["gateway"]:  # each as its own slot's NATS user
            gateway = f"http://127.0.0.1:{instance.env['HALFMOON_PORT']}"
            assert httpx.get(f"{gateway}/v1/models", timeout=10).status_code == 401, "compose's gateway needs a key"
            auth = {"authorization": f"Bearer {key}"}
            model = httpx.get(f"{gateway}/v1/models", headers=auth, timeout=10).json()["data"][0]["id"]
            reply = httpx.post(
                f"{gateway}/v1/completions",
                headers=auth,
                timeout=120,
                json={"model": model, "prompt": "the cache block", "max_tokens": 8, "temperature": 0},
            )
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-request-id"] and reply.json()["usage"]["completion_tokens"] > 0
