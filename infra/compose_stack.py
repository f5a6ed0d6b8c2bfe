"""The compose project under check, and HTTP to its API as an OpenAI client would speak it."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from compose_engine import DOCKER, Failed, log, poll, run

SCALE = {"prefill": 2, "decode": 2, "gateway": 2}
LONG_RUNNING = ("nats", "s3", "prometheus", "conductor", "cache-manager", "transfer", "prefill", "decode", "gateway", "lb")
ONE_SHOT = ("secrets", "models", "s3-bucket")
HEALTHCHECKED = {"nats", "s3", "conductor", "cache-manager", "transfer", "prefill", "decode", "gateway"}

# ---------------------------------------------------------------------------------------------- the stack

class Stack:
    def __init__(self, compose: list[str], files: list[str], project: str, env: dict[str, str], offline: bool,
                 logs: Path) -> None:
        self.compose, self.files, self.project, self.env, self.offline, self.logs = (
            compose, files, project, env, offline, logs)
        self.api = f"http://127.0.0.1:{env['HALFMOON_GATEWAY_PORT']}"
        self.seen_names: set[str] = set()  # every container name of the project seen: its network endpoints
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
        # a container removed between `ps` and `inspect` (Compose replacing it) is missing from the answer,
        # which then exits 1: what is there is still listed
        found = json.loads(run([DOCKER, "inspect", *ids], capture=True, quiet=True, check=False).stdout or "[]")
        self.seen_names.update(c["Name"].lstrip("/") for c in found)
        return found

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
        left = []
        for kind, cmd in (("container", [DOCKER, "ps", "-aq"]), ("volume", [DOCKER, "volume", "ls", "-q"]),
                          ("network", [DOCKER, "network", "ls", "-q"])):
            for item in run([*cmd, "--filter", self.label], capture=True, quiet=True).stdout.split():
                left.append(f"{kind} {item}")
        return left

    @property
    def label(self) -> str:
        return f"label=com.docker.compose.project={self.project}"

    def endpoint_names(self) -> set[str]:
        """The names a container of this project has had (an endpoint is named after its container):
        those seen in this run, and the ones Compose v2 and v1 give every replica, for what an earlier run
        left behind."""
        services = self.run("config", "--services", capture=True, quiet=True, check=False).stdout.split()
        numbered = {f"{self.project}{sep}{service}{sep}{n}" for service in services
                    for n in range(1, SCALE.get(service, 1) + 1) for sep in "-_"}
        return self.seen_names | numbered | {f"{self.project}-reference"}

    def down(self) -> None:
        """`down -v`, then whatever it could not remove. A container killed from the host can leave a stale
        endpoint on the project's network that `network inspect` does not list and that fails `down`
        with "has active endpoints", in this run and in every later one: each endpoint a container of the
        project could have had is force-disconnected and the network removed. A container that `down` had
        to kill after its stop timeout releases its endpoint a moment after it is gone, so the removal is
        retried until the networks are gone."""
        self.containers()  # what is there now names endpoints too; each service stops within its own grace period
        subprocess.run([DOCKER, "rm", "-f", f"{self.project}-reference"], capture_output=True)
        result = self.run("down", "-v", "--remove-orphans", capture=True, timeout=600, check=False)
        networks = self.networks()
        if result.returncode == 0 and not networks:
            return
        log(f"`down` exited {result.returncode}: {(result.stderr or '').strip().splitlines()[-1:]}; removing "
            f"{len(networks)} network(s) of {self.project} by hand")
        poll(f"the networks of {self.project} removed", self._remove_networks, 60)
        self.run("down", "-v", "--remove-orphans", capture=True, timeout=600)  # the volumes

    def networks(self) -> list[str]:
        return run([DOCKER, "network", "ls", "-q", "--filter", self.label], capture=True, quiet=True).stdout.split()

    def _remove_networks(self) -> bool:
        """One try at removing the project's networks and everything attached to them: True when none is left."""
        for container in run([DOCKER, "ps", "-aq", "--filter", self.label], capture=True, quiet=True).stdout.split():
            run([DOCKER, "rm", "-f", "-v", container], capture=True, quiet=True, check=False)
        for network in self.networks():
            listed = run([DOCKER, "network", "inspect", "-f", "{{range .Containers}}{{.Name}} {{end}}", network],
                         capture=True, quiet=True, check=False).stdout.split()
            for name in sorted(self.endpoint_names() | set(listed)):
                if run([DOCKER, "network", "disconnect", "-f", network, name], capture=True, quiet=True,
                       check=False).returncode == 0:
                    log(f"force-disconnected endpoint {name} from network {network}")
            removed = run([DOCKER, "network", "rm", network], capture=True, quiet=True, check=False)
            if removed.returncode != 0:
                log(f"network {network} not removed yet: {removed.stderr.strip()}")
        return not self.networks()


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
