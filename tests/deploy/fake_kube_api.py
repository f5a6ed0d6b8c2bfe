"""A fake Kubernetes API server for the planner's actuator: a real HTTPS server on a loopback port that
serves the ``scale`` subresource of apps/v1 workloads from memory. Like the real one, it requires the
bearer token, authorizes each request by RBAC rules (a Role's ``rules``), accepts only merge patches, and
validates every request body, and the object it would store, against the Kubernetes API schema
(kubernetes-validate's strict JSON schema of autoscaling/v1 Scale); a body it rejects changes nothing."""

from __future__ import annotations

import json
import re
import ssl
import threading
from collections.abc import Iterable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from tests.deploy.conftest import K8S_VERSION

SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/(?P<namespace>[^/]+)/(?P<resource>deployments|statefulsets)/"
                        r"(?P<name>[^/]+)/scale$")
VERBS = {"GET": "get", "PATCH": "patch", "PUT": "update"}
MERGE_PATCH = "application/merge-patch+json"


class Rejected(Exception):
    def __init__(self, status: HTTPStatus, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: what the API server makes of a merge patch."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def _scale_validator() -> jsonschema.Draft202012Validator:
    """kubernetes-validate's strict schema of autoscaling/v1 Scale, whatever kind a body claims to be."""
    directory = f"kubernetes-json-schema/v{K8S_VERSION}-local-strict"
    schema = schema_contents(f"{directory}/scale-autoscaling-v1.json", K8S_VERSION)
    definitions = schema_contents(f"{directory}/_definitions.json", K8S_VERSION)
    registry: Registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


SCALE_SCHEMA = _scale_validator()


def validate_scale(body: dict[str, Any]) -> None:
    error = jsonschema.exceptions.best_match(SCALE_SCHEMA.iter_errors(body))
    if error is not None:
        path = ".".join(str(p) for p in error.path)
        raise Rejected(HTTPStatus.UNPROCESSABLE_ENTITY, "Invalid", f"Scale.autoscaling {path}: {error.message}")


class FakeKubernetesApi:
    """``workloads``: (resource, name) -> replicas, e.g. ("deployments", "prefill") -> 1. ``rules``: RBAC
    PolicyRules granted to the bearer of ``token``. ``rejected`` lists the bodies it refused as invalid."""

    def __init__(self, token: str, namespace: str, workloads: Mapping[tuple[str, str], int],
                 rules: Iterable[Mapping[str, Any]], cert: Path, key: Path) -> None:
        self.token, self.namespace, self.rules = token, namespace, list(rules)
        self.scales = {(resource, name): self._scale(resource, name, replicas)
                       for (resource, name), replicas in workloads.items()}
        self.rejected: list[str] = []
        self.patches: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self._thread = threading.Thread(target=self.server.serve_forever, name="fake-kube-api", daemon=True)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeKubernetesApi:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)

    def replicas(self, resource: str, name: str) -> int:
        with self._lock:
            replicas: int = self.scales[(resource, name)]["spec"]["replicas"]
            return replicas

    def _scale(self, resource: str, name: str, replicas: int) -> dict[str, Any]:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": self.namespace, "resourceVersion": "1"},
                "spec": {"replicas": replicas},
                "status": {"replicas": replicas, "selector": f"app.kubernetes.io/name={name}"}}

    def _allowed(self, verb: str, resource: str, name: str) -> bool:
        return any("apps" in rule.get("apiGroups", ()) and f"{resource}/scale" in rule.get("resources", ())
                   and verb in rule.get("verbs", ()) and name in rule.get("resourceNames", (name,))
                   for rule in self.rules)

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> dict[str, Any]:
        """The object to answer with (``headers``: lower-cased names); raises :class:`Rejected` for an
        error ``Status``."""
        if headers.get("authorization") != f"Bearer {self.token}":
            raise Rejected(HTTPStatus.UNAUTHORIZED, "Unauthorized", "Unauthorized")
        match = SCALE_PATH.match(path)
        if match is None or match["namespace"] != self.namespace:
            raise Rejected(HTTPStatus.NOT_FOUND, "NotFound", f"the server could not find the requested resource {path}")
        resource, name, verb = match["resource"], match["name"], VERBS.get(method, method.lower())
        if not self._allowed(verb, resource, name):
            raise Rejected(HTTPStatus.FORBIDDEN, "Forbidden",
                           f'{resource}.apps "{name}" is forbidden: User "system:serviceaccount:{self.namespace}:'
                           f'planner" cannot {verb} resource "{resource}/scale" in API group "apps" in the '
                           f'namespace "{self.namespace}"')
        with self._lock:
            current = self.scales.get((resource, name))
            if current is None:
                raise Rejected(HTTPStatus.NOT_FOUND, "NotFound", f'{resource}.apps "{name}" not found')
            if method == "GET":
                return current
            if method != "PATCH":
                raise Rejected(HTTPStatus.METHOD_NOT_ALLOWED, "MethodNotAllowed", f"{method} is not served here")
            if headers.get("content-type") != MERGE_PATCH:
                raise Rejected(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType",
                               f"the body of the request was in an unknown format - accepted media types "
                               f"include: {MERGE_PATCH}")
            try:
                patch = json.loads(body)
            except ValueError as exc:
                raise Rejected(HTTPStatus.BAD_REQUEST, "BadRequest", f"invalid JSON: {exc}") from None
            if not isinstance(patch, dict):
                raise Rejected(HTTPStatus.BAD_REQUEST, "BadRequest", "a merge patch of a Scale is an object")
            try:
                # the patch itself must be (part of) a Scale, and so must what it makes
                validate_scale({"apiVersion": "autoscaling/v1", "kind": "Scale", **patch})
                updated = merge_patch(current, patch)
                validate_scale(updated)
            except Rejected as exc:
                self.rejected.append(exc.message)
                raise
            if updated["metadata"]["name"] != name:
                raise Rejected(HTTPStatus.BAD_REQUEST, "BadRequest", "the name of the object does not match")
            updated["metadata"]["resourceVersion"] = str(int(current["metadata"]["resourceVersion"]) + 1)
            self.scales[(resource, name)] = updated
            self.patches.append(patch)
            return updated

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                headers = {name.lower(): value for name, value in self.headers.items()}
                body = self.rfile.read(int(headers.get("content-length") or 0))
                try:
                    status, answer = HTTPStatus.OK, api.handle(self.command, self.path, headers, body)
                except Rejected as exc:
                    status, answer = exc.status, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                  "message": exc.message, "reason": exc.reason, "code": exc.status}
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_PUT = _serve

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler
