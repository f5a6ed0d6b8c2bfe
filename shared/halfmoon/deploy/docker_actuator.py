"""The planner's actuator for a compose deployment: the engine services' containers, through the Docker
Engine API on its unix socket (the standard library's HTTP client; no Docker SDK).

A compose service's replicas are the containers labelled with its project and service name. Scale-up
clones a running replica as `docker compose up --scale` would: its config, host config, networks and
aliases, the next container number and a name in compose's style, so compose counts it as one of its own
(`docker compose ps`, `down`). Scale-down stops one replica at a time with the grace period compose gives
the engines (``stop_grace_period``): SIGTERM, on which an engine drains (its heartbeat says leaving, the
conductor places nothing more on it, it finishes what it holds within its ``drain_timeout_s``) and exits.
Docker does not restart a container it was asked to stop, whatever its restart policy; once it has exited
it is removed.
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import socket
import threading
from typing import Any
from urllib.parse import quote, urlencode

from halfmoon.deploy.planner import ENGINE_ROLES, Actuator
from halfmoon.protocol.registry import Role

log = logging.getLogger("halfmoon.planner")

DOCKER_SOCKET = "/var/run/docker.sock"
PROJECT = "com.docker.compose.project"
SERVICE = "com.docker.compose.service"
NUMBER = "com.docker.compose.container-number"
ONEOFF = "com.docker.compose.oneoff"
STOP_GRACE_S = 40.0  # docker-compose.yml's stop_grace_period for the engines: above their drain_timeout_s (30)
SERVING_STATES = ("running", "restarting")  # a replica compose restarts after a crash is still one of the pool


class DockerError(RuntimeError):
    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        super().__init__(f"Docker API {method} {path}: {status} {message}")
        self.status = status


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.socket_path)
        self.sock = sock


class DockerApi:
    """JSON over the engine's unix socket, one connection per call (calls come from several threads)."""

    def __init__(self, socket_path: str = DOCKER_SOCKET, timeout_s: float = 60.0) -> None:
        self.socket_path, self.timeout_s = socket_path, timeout_s

    def call(self, method: str, path: str, body: Any = None, timeout_s: float | None = None, **query: Any) -> Any:
        """The decoded JSON answer (None for an empty one); DockerError for a status of 400 or more."""
        url = path + (f"?{urlencode(query)}" if query else "")
        conn = _UnixConnection(self.socket_path, self.timeout_s if timeout_s is None else timeout_s)
        try:
            payload = None if body is None else json.dumps(body).encode()
            conn.request(method, url, payload, {"Content-Type": "application/json"} if payload is not None else {})
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        if response.status >= 400:
            try:
                message = json.loads(data).get("message", "")
            except ValueError:
                message = data.decode(errors="replace")
            raise DockerError(method, path, response.status, message)
        return json.loads(data) if data else None


def clone_request(inspected: dict[str, Any], name: str, number: int) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """What creates a replica like the inspected container under ``name`` with compose container number
    ``number``: the body of ``POST /containers/create`` (attached to the first of its networks), and the
    aliases to connect it with on each network (the first included)."""
    old_name, short_id = inspected["Name"].lstrip("/"), inspected["Id"][:12]
    config = dict(inspected["Config"])
    if config.get("Hostname") == short_id:  # Docker's default: the container's own id; the clone gets its own
        del config["Hostname"]
    config["Labels"] = {**(config.get("Labels") or {}), NUMBER: str(number)}
    aliases = {}
    for network, endpoint in inspected["NetworkSettings"]["Networks"].items():
        own = [name if alias == old_name else alias for alias in endpoint.get("Aliases") or ()
               if alias not in (short_id, inspected["Config"].get("Hostname"))]
        aliases[network] = own
    first = next(iter(aliases), None)
    host_config = dict(inspected["HostConfig"])
    if first is not None:
        host_config["NetworkMode"] = first
    body = {**config, "HostConfig": host_config,
            "NetworkingConfig": {"EndpointsConfig": {} if first is None else {first: {"Aliases": aliases[first]}}}}
    return body, aliases


def replica_name(inspected: dict[str, Any], project: str, service: str, number: int) -> str:
    """Compose's name for replica ``number``: the inspected one's with its number replaced (compose v2 names
    them project-service-N, v1 project_service_N)."""
    name, own = inspected["Name"].lstrip("/"), inspected["Config"]["Labels"].get(NUMBER, "")
    for separator in "-_":
        if own and name.endswith(f"{separator}{own}"):
            return f"{name[:-len(own)]}{number}"
    return f"{project}-{service}-{number}"


def own_compose_project(api: DockerApi) -> str:
    """The compose project of the container this runs in (its hostname is its container id, as Docker sets it)."""
    labels = api.call("GET", f"/containers/{socket.gethostname()}/json")["Config"]["Labels"] or {}
    if PROJECT not in labels:
        raise RuntimeError(f"this container was not started by compose (no {PROJECT} label): set HALFMOON_COMPOSE_PROJECT")
    return str(labels[PROJECT])


class DockerActuator(Actuator):
    """The engine services (prefill, decode, aggregated: the services named after those roles) of compose
    project ``project``. ``stop_timeout_s`` is how long Docker waits for a drained replica to exit before it
    kills it: compose's ``stop_grace_period``, unless the container sets its own (``StopTimeout``)."""

    def __init__(self, project: str, api: DockerApi | None = None, stop_timeout_s: float = STOP_GRACE_S) -> None:
        self.project, self.api, self.stop_timeout_s = project, api or DockerApi(), stop_timeout_s
        self._lock = threading.Lock()
        self._leaving: set[str] = set()  # ids of replicas asked to stop, until removed
        self._drains: queue.Queue[str | None] = queue.Queue()
        self._drainer = threading.Thread(target=self._drain_loop, name="docker-drain", daemon=True)
        self._drainer.start()

    def replicas(self, role: Role, every_state: bool = False) -> list[dict[str, Any]]:
        """The service's containers (``GET /containers/json`` entries); running or restarting ones unless
        ``every_state``; one-off ones (`docker compose run`) never."""
        labels = [f"{PROJECT}={self.project}", f"{SERVICE}={role.value}", f"{ONEOFF}=False"]
        found = self.api.call("GET", "/containers/json", all=int(every_state), filters=json.dumps({"label": labels}))
        return [c for c in found if every_state or c["State"] in SERVING_STATES]

    def _staying(self, role: Role) -> list[dict[str, Any]]:
        with self._lock:
            leaving = set(self._leaving)
        return sorted((c for c in self.replicas(role) if c["Id"] not in leaving), key=_number)

    def counts(self) -> dict[Role, int]:
        return {role: len(self._staying(role)) for role in ENGINE_ROLES}

    def scale_to(self, role: Role, count: int) -> list[str]:
        staying = self._staying(role)
        if count >= len(staying):
            return [self._add(role, staying) for _ in range(count - len(staying))]
        # the newest go first, as compose's own scale-down does: the first replicas keep their caches
        leaving = staying[count:]
        with self._lock:
            self._leaving.update(c["Id"] for c in leaving)
        for container in reversed(leaving):
            self._drains.put(container["Id"])
        return [_name(c) for c in reversed(leaving)]

    def _add(self, role: Role, staying: list[dict[str, Any]]) -> str:
        if not staying:
            raise RuntimeError(f"compose project {self.project!r} runs no {role.value} replica to clone: "
                               f"`docker compose up` it first")
        template = self.api.call("GET", f"/containers/{staying[0]['Id']}/json")
        number = 1 + max(_number(c) for c in self.replicas(role, every_state=True))
        name = replica_name(template, self.project, role.value, number)
        body, aliases = clone_request(template, name, number)
        created = self.api.call("POST", "/containers/create", body, name=name)["Id"]
        for network, names in list(aliases.items())[1:]:
            self.api.call("POST", f"/networks/{quote(network)}/connect",
                          {"Container": created, "EndpointConfig": {"Aliases": names}})
        self.api.call("POST", f"/containers/{created}/start")
        log.info(f"started {name} (a clone of {_name(staying[0])})")
        return name

    def _drain_loop(self) -> None:
        while (container := self._drains.get()) is not None:
            try:
                self._drain(container)
            except Exception:
                log.exception(f"draining {container[:12]} failed; it is left as it is")
            finally:
                with self._lock:
                    self._leaving.discard(container)

    def _drain(self, container: str) -> None:
        inspected = self.api.call("GET", f"/containers/{container}/json")
        name, timeout = inspected["Name"].lstrip("/"), inspected["Config"].get("StopTimeout") or self.stop_timeout_s
        log.info(f"draining {name}: SIGTERM, at most {timeout:g} s to finish what it holds")
        self.api.call("POST", f"/containers/{container}/stop", timeout_s=timeout + 30, t=int(timeout))
        status = self.api.call("POST", f"/containers/{container}/wait", timeout_s=60)["StatusCode"]
        self.api.call("DELETE", f"/containers/{container}", v=1)
        level = logging.INFO if status == 0 else logging.WARNING
        log.log(level, f"{name} exited {status} after its drain{'' if status == 0 else ' (not a clean drain)'}; removed")

    def close(self, timeout_s: float | None = None) -> None:
        """After the drains under way (waiting up to ``timeout_s``), end the drainer."""
        self._drains.put(None)
        self._drainer.join(timeout_s)


def _number(container: dict[str, Any]) -> int:
    return int(container["Labels"].get(NUMBER) or 0)


def _name(container: dict[str, Any]) -> str:
    return str(container["Names"][0]).lstrip("/")
