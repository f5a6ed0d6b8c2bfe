"""The planner's Docker actuator against a real Docker engine: a dockerd of this test's own (its own data
root and socket, so it touches no other engine on the host), a compose project brought up by compose, and
an image imported from a few of the host's binaries (no registry, no build). The service's process drains
on SIGTERM as the engines do: it notes the signal, finishes after a moment and exits 0.

Skipped, with the reason, only where there is no dockerd, docker CLI or compose to run, or no root to
start a dockerd with (CI installs them and runs as root).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from halfmoon.core.kv_spec import KVSpec
from halfmoon.deploy.docker_actuator import (
    NUMBER,
    PROJECT,
    SERVICE,
    DockerActuator,
    DockerApi,
    DockerError,
    clone_request,
    replica_name,
)
from halfmoon.protocol import codecs
from halfmoon.protocol.registry import Heartbeat, Load, Role
from halfmoon.protocol.scheduling import Placed
from halfmoon.protocol.subjects import Subjects
from halfmoon.telemetry import read_spans
from tests.conftest import REPO_ROOT, NatsServer, Processes
from tests.planner.conftest import TBT_SLO_S, capped_profile_dict

sys.path.insert(0, str(REPO_ROOT / "infra"))  # the compose check's modules import each other by bare name
from compose_engine import Skipped, compose_command, host_image

IMAGE = "halfmoon-drain-test:latest"
DRAIN_SCRIPT = """\
trap 'echo draining >> /drain/$HOSTNAME; sleep 1; echo drained >> /drain/$HOSTNAME; exit 0' TERM
echo serving >> /drain/$HOSTNAME
while :; do sleep 1 & wait $!; done
"""


def poll(what: str, condition: Callable[[], Any], timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.2)  # the interval between checks of a condition, not a synchronisation
    return value


@pytest.fixture(scope="module")
def docker_host() -> Iterator[str]:
    """``unix://`` URL of a dockerd started for this module (stopped after), with the test image in it."""
    missing = [tool for tool in ("dockerd", "docker", "ldd") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)} here: the Docker actuator's test runs a dockerd")
    if os.geteuid() != 0:
        pytest.skip("dockerd needs root")
    # NOTE: a short directory: unix socket paths (containerd's under the exec root) have a 108-byte limit
    root = Path(tempfile.mkdtemp(prefix="hm-dockerd-", dir="/tmp"))
    socket_path = root / "docker.sock"
    log = (root / "dockerd.log").open("w")
    daemon = subprocess.Popen(
        ["dockerd", "--data-root", str(root / "data"), "--exec-root", str(root / "exec"), "--pidfile",
         str(root / "dockerd.pid"), "-H", f"unix://{socket_path}", "--iptables=false", "--bridge=none"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        api = DockerApi(str(socket_path), timeout_s=10)

        def answers() -> bool:
            assert daemon.poll() is None, f"dockerd exited {daemon.returncode}: {(root / 'dockerd.log').read_text()}"
            try:
                return api.call("GET", "/version") is not None
            except OSError:
                return False

        poll("dockerd to answer", answers, 90)
        host = f"unix://{socket_path}"
        shell, sleep = shutil.which("dash") or "/bin/sh", shutil.which("sleep") or "/bin/sleep"
        host_image(IMAGE, {"/bin/sh": shell, "/bin/sleep": sleep}, {"/drain.sh": DRAIN_SCRIPT}, ["/bin/sh", "/drain.sh"],
                   docker_host=host)
        yield host
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


COMPOSE_FILE = """\
services:
  prefill:
    image: {image}
    restart: unless-stopped
    volumes: ["{drain}:/drain"]
  decode:
    image: {image}
    restart: unless-stopped
    stop_grace_period: 30s
    volumes: ["{drain}:/drain"]
    networks: [default, kv]
networks:
  kv: {{}}
"""


class Project:
    def __init__(self, host: str, directory: Path, name: str) -> None:
        self.name, self.directory, self.drain = name, directory, directory / "drain"
        self.drain.mkdir()
        (directory / "compose.yml").write_text(COMPOSE_FILE.format(image=IMAGE, drain=self.drain))
        try:
            self.command = [*compose_command(), "-p", name, "-f", str(directory / "compose.yml")]
        except Skipped as exc:
            pytest.skip(str(exc))
        self.env = {**os.environ, "DOCKER_HOST": host}

    def compose(self, *args: str) -> str:
        done = subprocess.run([*self.command, *args], env=self.env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def marks(self, container: str) -> list[str]:
        path = self.drain / container[:12]
        return path.read_text().split() if path.exists() else []


@pytest.fixture
def project(docker_host: str, tmp_path: Path) -> Iterator[Project]:
    project = Project(docker_host, tmp_path, f"hm{os.getpid()}")
    project.compose("up", "-d")
    try:
        yield project
    finally:
        project.compose("down", "-v", "--timeout", "5")


def inspect(api: DockerApi, container: str) -> dict[str, Any] | None:
    try:
        result: dict[str, Any] = api.call("GET", f"/containers/{container}/json")
        return result
    except DockerError as exc:
        if exc.status == 404:
            return None
        raise


class TestDockerActuator:
    @pytest.mark.timeout(600)
    def test_scales_a_compose_service_up_by_cloning_and_down_by_draining(
            self, project: Project, docker_host: str, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.INFO, logger="halfmoon.planner")
        api = DockerApi(docker_host.removeprefix("unix://"))
        actuator = DockerActuator(project.name, api)
        try:
            assert actuator.counts() == {Role.PREFILL: 1, Role.DECODE: 1, Role.AGGREGATED: 0}
            first = actuator.replicas(Role.DECODE)[0]
            first_networks = set(inspect(api, first["Id"])["NetworkSettings"]["Networks"])  # type: ignore[index]
            assert len(first_networks) == 2

            started = actuator.scale_to(Role.DECODE, 3)
            assert len(started) == 2
            assert actuator.counts() == {Role.PREFILL: 1, Role.DECODE: 3, Role.AGGREGATED: 0}
            replicas = {c["Id"]: inspect(api, c["Id"]) for c in actuator.replicas(Role.DECODE)}
            assert sorted(int(r["Config"]["Labels"][NUMBER]) for r in replicas.values()) == [1, 2, 3]  # type: ignore[index]
            for container, replica in replicas.items():
                assert replica is not None and replica["State"]["Running"], replica
                labels = replica["Config"]["Labels"]
                assert (labels[PROJECT], labels[SERVICE]) == (project.name, "decode")
                networks = replica["NetworkSettings"]["Networks"]
                assert set(networks) == first_networks
                assert all("decode" in endpoint["Aliases"] for endpoint in networks.values()), networks
                assert replica["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
                poll(f"{replica['Name']} to serve", lambda c=container: project.marks(c) == ["serving"])
            # compose counts the clones as its own replicas
            assert set(project.compose("ps", "-q", "decode").split()) == set(replicas)
            assert {replica["Name"].lstrip("/") for replica in replicas.values()} >= set(started)

            clones = sorted(replicas, key=lambda c: replicas[c]["Config"]["Labels"][NUMBER])[1:]  # type: ignore[index]
            draining = actuator.scale_to(Role.DECODE, 1)
            assert sorted(draining) == sorted(started)

            def drained() -> bool:
                assert actuator.counts() == {Role.PREFILL: 1, Role.DECODE: 1, Role.AGGREGATED: 0}
                return all(inspect(api, c) is None for c in clones)

            poll("the drained replicas to be removed", drained)
            for container in clones:
                assert project.marks(container) == ["serving", "draining", "drained"]  # SIGTERM, then its own exit
            exits = [r.getMessage() for r in caplog.records if "after its drain" in r.getMessage()]
            assert sorted(exits) == sorted(f"{name} exited 0 after its drain; removed" for name in started)
            remaining = actuator.replicas(Role.DECODE, every_state=True)
            assert [c["Id"] for c in remaining] == [first["Id"]] and remaining[0]["State"] == "running"
            assert project.marks(first["Id"]) == ["serving"]
        finally:
            actuator.close(60)


SPEC = KVSpec(model_fingerprint="ab" * 16, block_size=16, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16)


async def report_load(nc: NATS, subjects: Subjects, per_s: float, stop: asyncio.Event) -> None:
    """What a decode engine's heartbeats and the conductor's placements say of ``per_s`` requests a second."""
    sent = 0
    while not stop.is_set():
        beat = Heartbeat(instance_id="decode-0", role=Role.DECODE, address="decode-0", load=Load(tbt_ms=150.0),
                         timestamp=time.time(), interval_s=0.5, kv_spec=SPEC)
        await nc.publish(subjects.heartbeat_from(Role.DECODE.value), codecs.HEARTBEAT.encode(beat))
        for _ in range(int(per_s / 2)):
            sent += 1
            placed = Placed(conductor="conductor-0", prefill_instance="prefill-0", decode_instance="decode-0",
                            request_id=f"cmpl-{sent}", prompt_tokens=10, max_tokens=16)
            await nc.publish(subjects.placed, codecs.PLACED.encode(placed))
        await nc.flush()
        await asyncio.sleep(0.5)  # the heartbeat interval


class TestPlannerService:
    @pytest.mark.timeout(600)
    async def test_scales_the_compose_engines_up_under_load_and_drains_after(
            self, project: Project, docker_host: str, nats_server: NatsServer, nc: NATS, namespace: str,
            processes: Processes, tmp_path: Path) -> None:
        """`python -m halfmoon.services.planner` as compose runs it, on NATS reports of a load that one prefill
        and one decode replica cannot serve within the SLOs by the profile (capacity by configuration)."""
        profile, spans = tmp_path / "profile.json", tmp_path / "spans.jsonl"
        profile.write_text(json.dumps(capped_profile_dict()))
        planner = processes.start(["-m", "halfmoon.services.planner"], {
            "HALFMOON_NATS_URL": nats_server.url, "HALFMOON_NAMESPACE": namespace, "HALFMOON_ACTUATOR": "docker",
            "HALFMOON_COMPOSE_PROJECT": project.name, "HALFMOON_DOCKER_SOCKET": docker_host.removeprefix("unix://"),
            "HALFMOON_PROFILE": str(profile), "HALFMOON_TBT_SLO_S": str(TBT_SLO_S), "HALFMOON_INTERVAL_S": "1",
            "HALFMOON_HORIZON_S": "10", "HALFMOON_MAX_INSTANCES": "4", "HALFMOON_TRACE_FILE": str(spans),
            "HALFMOON_LOG_FORMAT": "text"}, stderr=subprocess.PIPE, text=True)
        actuator = DockerActuator(project.name, DockerApi(docker_host.removeprefix("unix://")))

        def engines() -> int:
            assert planner.poll() is None, planner.stderr.read() if planner.stderr else planner.returncode
            counts = actuator.counts()
            return counts[Role.PREFILL] + counts[Role.DECODE]

        try:
            stop = asyncio.Event()
            load = asyncio.create_task(report_load(nc, Subjects(namespace), 8.0, stop))
            await asyncio.to_thread(poll, "the planner to start engines", lambda: engines() == 4)
            stop.set()
            await load
            await asyncio.to_thread(poll, "the planner to drain one after the load", lambda: engines() < 4)
        finally:
            actuator.close(5)
        planner.send_signal(signal.SIGTERM)
        _, err = planner.communicate(timeout=120)
        assert planner.returncode == 0, err
        decisions = [s["attributes"] for s in read_spans(spans) if s["name"] == "planner.decide"]
        assert {"up", "down"} <= {d["planner.action"] for d in decisions}, decisions
        ups = [line for line in err.splitlines() if " up " in line and "started" in line]
        assert ups, err[-3000:]

    def test_without_engines_to_size_it_exits_non_zero_saying_why(self, docker_host: str, nats_server: NatsServer,
                                                                  processes: Processes) -> None:
        planner = processes.start(["-m", "halfmoon.services.planner"], {
            "HALFMOON_NATS_URL": nats_server.url, "HALFMOON_COMPOSE_PROJECT": "nothing-runs-here",
            "HALFMOON_DOCKER_SOCKET": docker_host.removeprefix("unix://"), "HALFMOON_LOG_FORMAT": "text"},
            stderr=subprocess.PIPE, text=True)
        _, err = planner.communicate(timeout=120)
        assert planner.returncode == 1, err
        assert "the planner could not start" in err and "the deployment runs" in err, err


INSPECTED = {
    "Id": "0123456789abcdef" * 4, "Name": "/shop-decode-1",
    "Config": {"Hostname": "0123456789ab", "Image": "halfmoon:latest", "Env": ["A=1"],
               "Labels": {PROJECT: "shop", SERVICE: "decode", NUMBER: "1"}},
    "HostConfig": {"NetworkMode": "shop_default", "RestartPolicy": {"Name": "unless-stopped"}},
    "NetworkSettings": {"Networks": {
        "shop_default": {"Aliases": ["shop-decode-1", "decode", "0123456789ab"]},
        "shop_kv": {"Aliases": ["decode"]}}},
}


class TestCloneRequest:
    def test_a_clone_keeps_the_config_with_its_own_number_name_and_aliases(self) -> None:
        body, aliases = clone_request(INSPECTED, "shop-decode-4", 4)
        assert "Hostname" not in body  # Docker gives the clone its own id as hostname
        assert body["Image"] == "halfmoon:latest" and body["Env"] == ["A=1"]
        assert body["Labels"] == {PROJECT: "shop", SERVICE: "decode", NUMBER: "4"}
        assert body["HostConfig"] == {"NetworkMode": "shop_default", "RestartPolicy": {"Name": "unless-stopped"}}
        assert body["NetworkingConfig"] == {"EndpointsConfig": {"shop_default": {"Aliases": ["shop-decode-4", "decode"]}}}
        assert aliases == {"shop_default": ["shop-decode-4", "decode"], "shop_kv": ["decode"]}
        assert INSPECTED["Config"]["Labels"][NUMBER] == "1"  # type: ignore[index]  # the template is left as it was

    def test_names_follow_compose_v2_and_v1(self) -> None:
        assert replica_name(INSPECTED, "shop", "decode", 7) == "shop-decode-7"
        v1 = {**INSPECTED, "Name": "/shop_decode_1"}
        assert replica_name(v1, "shop", "decode", 7) == "shop_decode_7"
