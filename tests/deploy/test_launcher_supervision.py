"""`halfmoon up` as a user runs it (a real process tree): a SIGKILLed service and a SIGKILLed NATS
server are restarted and the deployment serves again; a crash loop ends it, naming the process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import Processes


class Up:
    """One `halfmoon up` process, its output in a file; stopped with Ctrl-C (SIGINT) at the end."""

    def __init__(self, processes: Processes, model: Path, run_dir: Path, *args: str,
                 env: dict[str, str] | None = None) -> None:
        self.run_dir = run_dir
        self.output = run_dir.parent / f"{run_dir.name}.out"
        with open(self.output, "wb") as out:
            self.proc = processes.start(
                ["-m", "halfmoon.cli.main", "up", "--model", str(model), "--run-dir", str(run_dir),
                 "--timeout", "900", *args],  # a shared, loaded machine can take minutes to import torch
                {"COLUMNS": "400", "HALFMOON_HEARTBEAT_INTERVAL_S": "0.25", "HALFMOON_INSTANCE_TIMEOUT_S": "1.5",
                 **(env or {})},
                stdout=out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def wait_for_output(self, needle: str, deadline_s: float = 900.0) -> None:
        end = time.monotonic() + deadline_s
        while needle not in self.text():
            assert self.proc.poll() is None, f"halfmoon up exited ({self.proc.returncode}):\n{self.text()}"
            assert time.monotonic() < end, f"no {needle!r} within {deadline_s}s:\n{self.text()}"
            time.sleep(0.2)

    def ready(self, instance_id: str) -> dict | None:
        try:
            return json.loads((self.run_dir / "ready" / f"{instance_id}.json").read_text())
        except (OSError, ValueError):
            return None

    def pid_of(self, instance_id: str) -> int:
        info = self.ready(instance_id)
        assert info is not None, f"{instance_id} is not up"
        return info["pid"]

    def nats_pids(self) -> list[int]:
        """The launcher's live nats-server children (a killed one is a zombie until it is reaped)."""
        found = []
        for child in psutil.Process(self.proc.pid).children():
            try:
                if child.name() == "nats-server" and child.status() != psutil.STATUS_ZOMBIE:
                    found.append(child.pid)
            except psutil.NoSuchProcess:
                pass
        return found

    @property
    def url(self) -> str:
        return str(self.ready("gateway-0")["address"])  # type: ignore[index]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=90)


def serves(url: str) -> bool:
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        response = httpx.post(f"{url}/v1/completions", timeout=60,
                              json={"model": model, "prompt": "the cache block", "max_tokens": 4, "temperature": 0})
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4


def until(condition, deadline_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"{what} not within {deadline_s}s"
        time.sleep(0.2)


def started_from(run_dir: Path) -> list[psutil.Process]:
    """Live processes of the deployment in ``run_dir`` (its config or ready files name the directory);
    another deployment running beside it (the module's ``up``) is not counted."""
    found = []
    for proc in psutil.process_iter():
        try:
            text = " ".join(proc.cmdline()) + " " + " ".join(proc.environ().values())
            if str(run_dir) in text and proc.status() != psutil.STATUS_ZOMBIE and proc.pid != os.getpid():
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(scope="module")
def up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    processes = Processes()
    running = Up(processes, tiny_model_dir, tmp_path_factory.mktemp("up") / "run", "--port", "0",
                 "--prefill", "1", "--decode", "1")
    try:
        running.wait_for_output("Halfmoon is up")
        yield running
    finally:
        running.stop()
        processes.stop_all()
    assert running.proc.returncode == 0, running.text()
    assert "nothing left running" in running.text()


class TestRestartsAKilledService:
    def test_decode_comes_back_with_its_instance_id_and_serves(self, up: Up) -> None:
        assert serves(up.url)
        old = up.pid_of("decode-0")
        os.kill(old, signal.SIGKILL)
        until(lambda: (up.ready("decode-0") or {}).get("pid") not in (None, old), 180, "a new decode-0 pid")
        until(lambda: serves(up.url), 120, "serving after the restart")
        assert "decode-0 exited with -9" in up.text() and "decode-0 restarted (restart 1)" in up.text()
        assert up.proc.poll() is None


class TestRestartsNats:
    def test_nats_comes_back_on_its_port_and_every_service_reconnects(self, up: Up) -> None:
        (old,) = up.nats_pids()
        os.kill(old, signal.SIGKILL)
        until(lambda: len(pids := up.nats_pids()) == 1 and old not in pids, 60, "a new nats-server")
        until(lambda: serves(up.url), 120, "serving after NATS came back")
        assert "nats exited with -9" in up.text() and "nats restarted" in up.text()


class TestCrashLoop:
    def test_a_crash_loop_stops_everything_and_names_the_service(
        self, tiny_model_dir: Path, tmp_path: Path, processes: Processes
    ) -> None:
        with socket.socket() as taken:  # the gateway's port is in use, so the gateway exits at every start
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            up = Up(processes, tiny_model_dir, tmp_path / "run", "--port", str(taken.getsockname()[1]),
                    "--prefill", "1", "--decode", "1", "--transfer", "0",
                    "--crash-loop-window", "900")  # a gateway start takes over 10 s on a loaded machine
            assert up.proc.wait(timeout=900) == 1, up.text()
        text = up.text()
        assert "gateway-0 is crash-looping: 5 exits within 900s" in text, text
        assert "address already in use" in text.lower(), text
        assert not started_from(tmp_path / "run"), "the crash loop left processes running"
