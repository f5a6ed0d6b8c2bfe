"""The two servers `benchmarks.peers` compares, each a subprocess on a free loopback port: Halfmoon
(`halfmoon up`) and vLLM's OpenAI server from its own virtual environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import httpx

from halfmoon.deploy.local import free_port


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

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "halfmoon.cli.main", "up", "--model", str(self.model_dir), "--port",
                str(self.port), "--run-dir", str(self.run_dir / f"{self.name}-run"), "--namespace", "peers",
                "--timeout", str(self.start_timeout_s), *self.up_args]

    def env(self) -> dict[str, str]:
        return {**os.environ, **{f"HALFMOON_{k}": v for k, v in self.settings.items()}}


class VllmServer(PeerServer):
    """vLLM on CPU: its KV cache in ``VLLM_CPU_KVCACHE_SPACE`` GiB, prefix caching on."""

    name = "vllm"

    def __init__(self, model_dir: Path, run_dir: Path, python: str, extra_args: Sequence[str] = (),
                 kv_cache_gib: int = 2, dtype: str = "auto") -> None:
        super().__init__(model_dir, run_dir)
        self.dtype = dtype
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
        return {**env, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)}


class BusyNeighbour:
    """One process spinning on a core for as long as the block runs: the neighbour every real server has
    (a load generator, a log shipper, a second job)."""

    def __enter__(self) -> BusyNeighbour:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()
