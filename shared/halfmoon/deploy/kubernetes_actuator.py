"""The planner's actuator for the Kubernetes manifests (infra/k8s): it reads and writes the ``scale``
subresource (``autoscaling/v1`` ``Scale``) of the engine workloads through the Kubernetes API, with the
standard library only (no client library to install in the image).

Draining on scale-down is Kubernetes' pod termination. Lowering ``spec.replicas`` makes the workload's
controller delete pods; the kubelet sends each one's process SIGTERM and waits up to the pod's
``terminationGracePeriodSeconds`` before SIGKILL. An engine on SIGTERM drains (halfmoon.runtime.host): its
heartbeat says ``leaving=draining``, the conductor places nothing more on it (a request reaching it in that
moment is refused as retryable and placed again), it finishes or hands back what it holds within its
``drain_timeout_s`` (30 s), says InstanceDown and exits. The engines' grace period (40 s, infra/k8s/base)
is longer than that drain, so the kubelet's SIGKILL never comes while an engine holds a request, and no
request is lost to a scale-down. The conductor places by heartbeats, not through a Service's endpoints,
so no endpoint removal races the drain. Which pods leave is the controller's choice, not the planner's.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from halfmoon.deploy.planner import ENGINE_ROLES, Actuator
from halfmoon.protocol.registry import Role

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# the engine workloads of infra/k8s/base (it runs disaggregated: no aggregated workload)
ENGINE_WORKLOADS: Mapping[Role, str] = {Role.PREFILL: "deployment/prefill", Role.DECODE: "deployment/decode"}
MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT_S = 10.0
_GROUP_PATHS = {"deployment": ("apis/apps/v1", "deployments"), "statefulset": ("apis/apps/v1", "statefulsets")}


class KubernetesApiError(RuntimeError):
    """A request about ``workload`` failed: ``status`` is the HTTP status (None when the API server was not
    reached), ``reason`` the API's (Forbidden, NotFound, Conflict, Invalid, ...)."""

    def __init__(self, workload: str, verb: str, status: int | None, reason: str, message: str) -> None:
        self.workload, self.verb, self.status, self.reason = workload, verb, status, reason
        where = "unreachable" if status is None else f"HTTP {status} {reason}"
        super().__init__(f"{verb} the scale of {workload}: {where}: {message}")


class Workload(NamedTuple):
    """A kubectl-style reference (``deployment/prefill``) and the path of its ``scale`` subresource."""

    reference: str
    scale_path: str

    @classmethod
    def parse(cls, reference: str, namespace: str) -> Workload:
        kind, _, name = reference.partition("/")
        if kind not in _GROUP_PATHS or not name:
            raise ValueError(f"an engine workload is deployment/NAME or statefulset/NAME, got {reference!r}")
        group, resource = _GROUP_PATHS[kind]
        return cls(reference, f"/{group}/namespaces/{namespace}/{resource}/{name}/scale")


class KubernetesActuator(Actuator):
    """Per engine role, one workload (``workloads``: role -> ``deployment/NAME`` or ``statefulset/NAME``)
    in ``namespace``, resized through its ``scale`` subresource; a role without one counts 0 and cannot be
    scaled. ``token``: a bearer token, or a file re-read on every request (the kubelet rotates projected
    service-account tokens). Needs only get and patch on those workloads' scale subresources
    (infra/k8s/overlays/planner)."""

    def __init__(self, api_url: str, token: str | Path, context: ssl.SSLContext | None, namespace: str,
                 workloads: Mapping[Role, str]) -> None:
        unknown = set(workloads) - set(ENGINE_ROLES)
        if unknown:
            raise ValueError(f"only engine roles are scaled, not {sorted(unknown)}")
        self.api_url, self.token, self.context = api_url.rstrip("/"), token, context
        self.workloads = {role: Workload.parse(ref, namespace) for role, ref in workloads.items()}

    @classmethod
    def in_cluster(cls, workloads: Mapping[Role, str], namespace: str | None = None, *,
                   service_account: Path = SERVICE_ACCOUNT,
                   environ: Mapping[str, str] = os.environ) -> KubernetesActuator:
        """As the pod's service account, against the API server of the cluster it runs in; ``namespace``
        defaults to the pod's own."""
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise RuntimeError("KUBERNETES_SERVICE_HOST/PORT are not set: not running in a Kubernetes pod")
        if ":" in host:  # an IPv6 address
            host = f"[{host}]"
        context = ssl.create_default_context(cafile=str(service_account / "ca.crt"))
        namespace = namespace or (service_account / "namespace").read_text().strip()
        return cls(f"https://{host}:{port}", service_account / "token", context, namespace, workloads)

    def counts(self) -> dict[Role, int]:
        """What each workload asks for (``spec.replicas``): pods still starting count, terminating ones not."""
        counts = dict.fromkeys(ENGINE_ROLES, 0)
        for role, workload in self.workloads.items():
            counts[role] = self._replicas(self._request(workload, "get", "GET"))
        return counts

    def scale_to(self, role: Role, count: int) -> list[str]:
        """Sets the workload's replicas; returns once the API server has accepted it, one entry per
        replica started or drained (the controller picks which pod leaves)."""
        if count < 0:
            raise ValueError(f"replicas must be >= 0, got {count}")
        workload = self.workloads.get(role)
        if workload is None:
            raise ValueError(f"no workload runs the {role.value} role: it has {sorted(self.workloads)}")
        have = self._replicas(self._request(workload, "get", "GET"))
        if count == have:
            return []
        self._request(workload, "patch", "PATCH", {"spec": {"replicas": count}})
        changed = range(have + 1, count + 1) if count > have else range(count + 1, have + 1)
        return [f"{workload.reference} replica {n}" for n in changed]

    def _replicas(self, scale: dict[str, Any]) -> int:
        return int(scale.get("spec", {}).get("replicas", 0))

    def _request(self, workload: Workload, verb: str, method: str,
                 body: dict[str, Any] | None = None) -> dict[str, Any]:
        token = self.token.read_text().strip() if isinstance(self.token, Path) else self.token
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = MERGE_PATCH
        request = urllib.request.Request(self.api_url + workload.scale_path, method=method, headers=headers,
                                         data=None if body is None else json.dumps(body).encode())
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S, context=self.context) as response:
                result: dict[str, Any] = json.loads(response.read())
                return result
        except urllib.error.HTTPError as exc:
            reason, message = _status(exc)
            raise KubernetesApiError(workload.reference, verb, exc.code, reason, message) from None
        except (urllib.error.URLError, OSError) as exc:
            raise KubernetesApiError(workload.reference, verb, None, "", str(exc)) from exc


def _status(error: urllib.error.HTTPError) -> tuple[str, str]:
    """The reason and message of the ``Status`` object the API server answers an error with."""
    text = error.read().decode(errors="replace")
    try:
        status = json.loads(text)
    except ValueError:
        return error.reason, text.strip() or error.reason
    if not isinstance(status, dict):
        return error.reason, text.strip()
    return str(status.get("reason") or error.reason), str(status.get("message") or text.strip())
