"""The servers `benchmarks.peers` compares, each on a free loopback port: Halfmoon (`halfmoon up`), vLLM's
OpenAI server from its own virtual environment, and two vLLM servers behind a round-robin proxy, with or
without Halfmoon's KV pool between them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import httpx

from halfmoon.deploy.local import LocalCluster
from halfmoon.deploy.processes import core_share, free_port
from halfmoon.protocol.permissions import KV_CLIENT

SOURCE = Path(__file__).resolve().parents[1] / "shared"  # the connector, for vLLM's interpreter
POOL_COUNTS = {"gateway": 0, "conductor": 0, "prefill": 0, "decode": 0, "aggregated": 0, "cache-manager": 1,
               "transfer": 1}


class PeerServer:
    """Contract: ``start`` returns once a completion succeeds (or raises, leaving nothing running);
    ``stop`` interrupts the whole process group, waits, then kills what is left."""

    name = "server"

    def __init__(self, model_dir: Path, run_dir: Path, start_timeout_s: float = 1800.0) -> None:
        self.start_timeout_s = start_timeout_s
        self.model_dir = model_dir
        self.run_dir = run_dir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def metrics_url(self) -> str | None:
        return None

    @property
    def log_path(self) -> Path:
        return self.run_dir / f"{self.name}.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self) -> PeerServer:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.command(), env=self.env(), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        """Ready when a one-token completion succeeds: a gateway may list models before its engines join."""
        assert self.proc is not None
        end = time.monotonic() + self.start_timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            if not self._find_port():
                time.sleep(1.0)
                continue
            try:
                models = httpx.get(f"{self.base_url}/models", timeout=5)
                if models.status_code == 200:
                    probe = {"model": models.json()["data"][0]["id"], "prompt": [100], "max_tokens": 1}
                    if httpx.post(f"{self.base_url}/completions", json=probe, timeout=60).status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready after {self.start_timeout_s:.0f}s; see {self.log_path}")

    def _find_port(self) -> bool:
        """Whether ``port`` is known yet (a server told its port up front has it from the start)."""
        return True

    def pids(self) -> list[int]:
        """The roots of the server's process trees."""
        return [self.proc.pid] if self.proc is not None else []

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


class HalfmoonServer(PeerServer):
    """`halfmoon up` (1 prefill + 1 decode unless ``up_args`` say otherwise, e.g. ``--aggregated 1``);
    ``settings`` are HALFMOON_* variables every service reads (e.g. ``{"ADMISSION": "none"}``)."""

    def __init__(self, model_dir: Path, run_dir: Path, name: str = "halfmoon", up_args: Sequence[str] = (),
                 settings: dict[str, str] | None = None) -> None:
        super().__init__(model_dir, run_dir)
        self.name = name
        self.up_args = list(up_args)
        self.settings = dict(settings or {})
        # NOTE: `up --port 0`: its gateway binds a free port and reports it. A port picked here and bound
        # seconds later was once taken meanwhile as the local end of a service's NATS connection, and the
        # gateway crash-looped on "address already in use".
        self.port = 0

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "halfmoon.cli.main", "up", "--model", str(self.model_dir), "--port", "0",
                "--run-dir", str(self.up_run_dir), "--namespace", "peers", "--timeout", str(self.start_timeout_s),
                *self.up_args]

    @property
    def up_run_dir(self) -> Path:
        return self.run_dir / f"{self.name}-run"

    def start(self) -> PeerServer:
        self.port = 0
        (self.up_run_dir / "ready" / "gateway-0.json").unlink(missing_ok=True)  # a run dir used before
        return super().start()

    def _find_port(self) -> bool:
        """The gateway's port, from the record `up` writes once the gateway has bound it."""
        if not self.port:
            try:
                address = json.loads((self.up_run_dir / "ready" / "gateway-0.json").read_text())["address"]
            except (OSError, ValueError, KeyError):
                return False
            self.port = int(str(address).rsplit(":", 1)[1])
        return True

    def env(self) -> dict[str, str]:
        return {**os.environ, **{f"HALFMOON_{k}": v for k, v in self.settings.items()}}


class VllmServer(PeerServer):
    """vLLM on CPU: its KV cache in ``VLLM_CPU_KVCACHE_SPACE`` GiB, prefix caching on."""

    name = "vllm"

    def __init__(self, model_dir: Path, run_dir: Path, python: str, extra_args: Sequence[str] = (),
                 kv_cache_gib: int = 2, dtype: str = "auto", extra_env: dict[str, str] | None = None) -> None:
        super().__init__(model_dir, run_dir)
        self.dtype = dtype
        self.extra_env = dict(extra_env or {})
        self.python = python
        self.extra_args = list(extra_args)
        self.kv_cache_gib = kv_cache_gib

    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", self.model_dir.name, "--dtype", self.dtype,
                "--enable-prompt-tokens-details", "--host", "127.0.0.1",
                "--port", str(self.port), *self.extra_args]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HALFMOON_", "VIRTUAL_ENV", "PYTHON"))}
        return {**env, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), **self.extra_env}


class VllmPair(PeerServer):
    """Two vLLM servers at their defaults, each on its own half of the cores, behind a round-robin proxy
    (benchmarks/round_robin.py), as a Kubernetes Service spreads requests over two pods. With ``pool``,
    both run Halfmoon's KV connector on one Halfmoon pool (a cache-manager and a transfer node, security
    on): a prompt either computed is the other's pool hit. Without, each has its own prefix cache only."""

    def __init__(self, model_dir: Path, run_dir: Path, python: str, extra_args: Sequence[str] = (),
                 dtype: str = "auto", pool: bool = False) -> None:
        super().__init__(model_dir, run_dir)
        self.python, self.extra_args, self.dtype, self.pool = python, list(extra_args), dtype, pool
        self.cluster: LocalCluster | None = None
        self.servers: list[VllmServer] = []

    def command(self) -> list[str]:
        return [sys.executable, "-m", "benchmarks.round_robin", "--port", str(self.port),
                *(arg for server in self.servers for arg in ("--upstream", f"http://127.0.0.1:{server.port}"))]

    def _connector(self) -> tuple[list[str], dict[str, str]]:
        """vLLM's arguments and environment for the pool's connector (none without the pool)."""
        if not self.pool:
            return [], {}
        self.cluster = LocalCluster(self.run_dir, self.run_dir / f"{self.name}-pool", POOL_COUNTS,
                                    namespace="peers", gateway_port=0)
        self.cluster.start(timeout=120)
        assert self.cluster.nats_auth is not None
        config = {"kv_connector": "HalfmoonConnector", "kv_connector_module_path": "halfmoon.connectors.vllm",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
        env = {"PYTHONPATH": str(SOURCE), "HALFMOON_NATS_URL": self.cluster.nats_url or "",
               "HALFMOON_NAMESPACE": self.cluster.namespace, "HALFMOON_CLUSTER_SECRET": self.cluster.cluster_secret,
               **self.cluster.nats_auth.env(KV_CLIENT)}
        return ["--kv-transfer-config", json.dumps(config)], env

    def start(self) -> PeerServer:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            args, env = self._connector()
            cores = os.cpu_count() or 1
            for index in range(2):
                server = VllmServer(self.model_dir, self.run_dir, self.python, [*self.extra_args, *args],
                                    dtype=self.dtype,
                                    extra_env={**env, "VLLM_CPU_OMP_THREADS_BIND": core_share(index, 2, cores)})
                server.name = f"{self.name}-{index}"
                server.start_timeout_s = self.start_timeout_s
                self.servers.append(server)
                server.start()
        except BaseException:
            self.stop()
            raise
        return super().start()

    def pids(self) -> list[int]:
        cluster = list(self.cluster.pids().values()) if self.cluster is not None else []
        return [*super().pids(), *(pid for server in self.servers for pid in server.pids()), *cluster]

    def stop(self, timeout_s: float = 60.0) -> None:
        super().stop(timeout_s)
        for server in self.servers:
            server.stop(timeout_s)
        self.servers = []
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


class BusyNeighbour:
    """One process spinning on a core for as long as the block runs: the neighbour every real server has
    (a load generator, a log shipper, a second job)."""

    def __enter__(self) -> BusyNeighbour:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()
