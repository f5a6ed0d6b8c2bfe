"""The compose check's `down` (infra/compose_stack.py) against a real Docker engine. A container killed from
the host can leave a stale endpoint on the project's network, named after the container, which fails
`down -v` with "has active endpoints" in that run and every later one. Here a running container with a
replica's name but none of the project's labels holds that endpoint (`down -v` does not remove it, so it
fails the same way); the check's `down` must still leave no network of the project behind.

Runs after tests/deploy/test_compose_stack.py (which starts an engine where it can); skipped when no engine
answers. The container runs the host's `sleep` from an imported image: no registry and no build.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "infra"))  # the check's modules import each other by bare name
from compose_engine import DOCKER, compose_command, docker_ok, host_image
from compose_stack import Stack


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DOCKER, *args], capture_output=True, text=True, check=check, timeout=120)


def sleep_image(tag: str) -> None:
    """An image holding only the host's `sleep` and the libraries it links."""
    sleep = str(Path("/bin/sleep").resolve())
    host_image(tag, {sleep: sleep, "/sleep": sleep})


@pytest.fixture
def engine() -> None:
    if not docker_ok():
        pytest.skip("no Docker engine answers")


class TestDown:
    def test_an_endpoint_down_cannot_remove_is_forced_off_and_the_network_removed(self, engine: None,
                                                                                  tmp_path: Path) -> None:
        project = f"hmdown{os.getpid()}"
        image = f"{project}-sleep:latest"
        network = f"{project}_default"
        stray = f"{project}_decode_1"  # a replica's name (Compose v1), without the project's labels
        env = {**os.environ, "HALFMOON_GATEWAY_PORT": "1", "HALFMOON_PROMETHEUS_PORT": "1"}
        stack = Stack(compose_command(), ["-f", str(REPO_ROOT / "docker-compose.yml")], project, env, offline=False,
                      logs=tmp_path)
        sleep_image(image)
        try:
            docker("network", "create", "--label", f"com.docker.compose.project={project}",
                   "--label", "com.docker.compose.network=default", network)
            docker("run", "-d", "--name", stray, "--network", network, image, "/sleep", "600")
            plain_down = stack.run("down", "-v", "--remove-orphans", capture=True, check=False)
            assert "active endpoints" in plain_down.stdout + plain_down.stderr
            network_id = docker("network", "inspect", "-f", "{{.Id}}", network).stdout.strip()
            assert stack.leftovers() == [f"network {network_id[:12]}"]

            stack.down()

            assert stack.leftovers() == []
            assert docker("network", "inspect", network, check=False).returncode != 0
        finally:
            docker("rm", "-f", stray, check=False)
            docker("network", "rm", network, check=False)
            docker("rmi", "-f", image, check=False)
