"""The planner's Kubernetes actuator against a fake API server (tests/deploy/fake_kube_api.py): real HTTPS
on a loopback port, the planner overlay's workloads and RBAC rules, every request body validated against
the Kubernetes API schema."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from halfmoon.deploy.certs import write_certificates
from halfmoon.deploy.kubernetes_actuator import ENGINE_WORKLOADS, KubernetesActuator, KubernetesApiError
from halfmoon.deploy.planner import deployment_mode
from halfmoon.protocol.registry import Role
from halfmoon.sim.plan import DISAGGREGATED
from tests.deploy.conftest import workloads
from tests.deploy.fake_kube_api import MERGE_PATCH, FakeKubernetesApi

TOKEN = "planner-token"
NAMESPACE = "halfmoon"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("kube-api-tls")
    write_certificates(directory, ["127.0.0.1"], [])
    return directory


@pytest.fixture
def api(k8s_planner: list[dict[str, Any]], tls: Path) -> Iterator[FakeKubernetesApi]:
    """The API server of a cluster the planner overlay was applied to, as the planner's service account."""
    scaled = {(f"{w['kind'].lower()}s", name): w["spec"]["replicas"] for name, w in workloads(k8s_planner).items()}
    rules = next(d for d in k8s_planner if d["kind"] == "Role" and d["metadata"]["name"] == "planner")["rules"]
    with FakeKubernetesApi(TOKEN, NAMESPACE, scaled, rules, tls / "server.pem", tls / "server-key.pem") as fake:
        yield fake


def actuator(api: FakeKubernetesApi, tls: Path, token: str = TOKEN,
             workloads: dict[Role, str] | None = None) -> KubernetesActuator:
    context = ssl.create_default_context(cafile=str(tls / "ca.pem"))
    return KubernetesActuator(api.url, token, context, NAMESPACE, ENGINE_WORKLOADS if workloads is None else workloads)


def send(api: FakeKubernetesApi, tls: Path, method: str, path: str, body: Any,
         content_type: str = MERGE_PATCH) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(api.url + path, method=method, data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": content_type})
    context = ssl.create_default_context(cafile=str(tls / "ca.pem"))
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


DECODE_SCALE = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/decode/scale"


class TestScaling:
    def test_counts_are_the_workloads_replicas(self, api: FakeKubernetesApi, tls: Path) -> None:
        counts = actuator(api, tls).counts()
        assert counts == {Role.PREFILL: 1, Role.DECODE: 1, Role.AGGREGATED: 0}
        assert deployment_mode(counts) == DISAGGREGATED  # what the planner needs of them

    def test_up_and_down_through_the_scale_subresource(self, api: FakeKubernetesApi, tls: Path) -> None:
        kube = actuator(api, tls)
        assert kube.scale_to(Role.DECODE, 3) == ["deployment/decode replica 2", "deployment/decode replica 3"]
        assert api.replicas("deployments", "decode") == 3
        assert kube.counts() == {Role.PREFILL: 1, Role.DECODE: 3, Role.AGGREGATED: 0}
        assert kube.scale_to(Role.DECODE, 2) == ["deployment/decode replica 3"]
        assert kube.scale_to(Role.PREFILL, 2) == ["deployment/prefill replica 2"]
        assert kube.counts() == {Role.PREFILL: 2, Role.DECODE: 2, Role.AGGREGATED: 0}
        assert api.patches == [{"spec": {"replicas": n}} for n in (3, 2, 2)]
        assert not api.rejected

    def test_asking_for_what_runs_changes_nothing(self, api: FakeKubernetesApi, tls: Path) -> None:
        assert actuator(api, tls).scale_to(Role.DECODE, 1) == []
        assert api.patches == []

    def test_a_role_without_a_workload_cannot_be_scaled(self, api: FakeKubernetesApi, tls: Path) -> None:
        with pytest.raises(ValueError, match="aggregated"):
            actuator(api, tls).scale_to(Role.AGGREGATED, 1)


class TestTheFakeChecksBodiesAgainstTheSchema:
    @pytest.mark.parametrize("body", [
        {"spec": {"replicas": "3"}},  # a string where the schema has an integer
        {"spec": {"replica": 3}},  # a field Scale has not
        {"kind": "Deployment", "spec": {"replicas": 3}},  # not a Scale
    ])
    def test_a_body_the_schema_rejects_is_refused_and_changes_nothing(
            self, api: FakeKubernetesApi, tls: Path, body: dict[str, Any]) -> None:
        status, answer = send(api, tls, "PATCH", DECODE_SCALE, body)
        assert (status, answer["reason"]) == (422, "Invalid")
        assert api.rejected and api.patches == []
        assert actuator(api, tls).counts()[Role.DECODE] == 1

    def test_the_same_body_well_formed_is_accepted(self, api: FakeKubernetesApi, tls: Path) -> None:
        assert send(api, tls, "PATCH", DECODE_SCALE, {"spec": {"replicas": 3}})[0] == 200
        assert api.replicas("deployments", "decode") == 3

    def test_only_merge_patches(self, api: FakeKubernetesApi, tls: Path) -> None:
        status, _ = send(api, tls, "PATCH", DECODE_SCALE, [{"op": "replace", "path": "/spec/replicas", "value": 3}],
                         content_type="application/json-patch+json")
        assert status == 415
        assert api.replicas("deployments", "decode") == 1


class TestErrors:
    def test_a_wrong_token_is_unauthorized(self, api: FakeKubernetesApi, tls: Path) -> None:
        with pytest.raises(KubernetesApiError) as caught:
            actuator(api, tls, token="not-the-token").counts()
        assert caught.value.status == 401 and caught.value.workload in ENGINE_WORKLOADS.values()

    def test_a_workload_the_role_does_not_grant_is_forbidden(self, api: FakeKubernetesApi, tls: Path) -> None:
        """The overlay's Role names the engines only: the gateway StatefulSet, though it exists, is not the
        planner's to scale."""
        kube = actuator(api, tls, workloads={Role.DECODE: "statefulset/gateway"})
        with pytest.raises(KubernetesApiError, match=r"statefulset/gateway: HTTP 403 Forbidden: .*cannot get") as caught:
            kube.scale_to(Role.DECODE, 5)
        assert (caught.value.status, caught.value.reason, caught.value.verb) == (403, "Forbidden", "get")
        assert api.replicas("statefulsets", "gateway") == 2

    def test_a_missing_workload_is_not_found(self, api: FakeKubernetesApi, tls: Path) -> None:
        api.rules.append({"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get"]})
        with pytest.raises(KubernetesApiError, match=r"deployment/aggregated: HTTP 404 NotFound") as caught:
            actuator(api, tls, workloads={Role.AGGREGATED: "deployment/aggregated"}).counts()
        assert caught.value.status == 404

    def test_an_api_server_it_cannot_reach(self, tls: Path) -> None:
        context = ssl.create_default_context(cafile=str(tls / "ca.pem"))
        kube = KubernetesActuator("https://127.0.0.1:1", TOKEN, context, NAMESPACE, ENGINE_WORKLOADS)
        with pytest.raises(KubernetesApiError, match="unreachable") as caught:
            kube.counts()
        assert caught.value.status is None

    def test_a_workload_reference_names_its_kind(self) -> None:
        with pytest.raises(ValueError, match="deployment/NAME"):
            KubernetesActuator("https://127.0.0.1:1", TOKEN, None, NAMESPACE, {Role.DECODE: "decode"})


class TestInCluster:
    @pytest.fixture
    def service_account(self, tmp_path: Path, tls: Path) -> Path:
        (tmp_path / "ca.crt").write_bytes((tls / "ca.pem").read_bytes())
        (tmp_path / "token").write_text(TOKEN + "\n")
        (tmp_path / "namespace").write_text(NAMESPACE)
        return tmp_path

    def test_as_the_pods_service_account(self, api: FakeKubernetesApi, service_account: Path) -> None:
        environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": api.url.rsplit(":", 1)[1]}
        kube = KubernetesActuator.in_cluster(ENGINE_WORKLOADS, service_account=service_account, environ=environ)
        assert kube.scale_to(Role.DECODE, 2) == ["deployment/decode replica 2"]
        api.token = "rotated"  # the kubelet rotates projected tokens: the file is read again each request
        with pytest.raises(KubernetesApiError, match="401"):
            kube.counts()
        (service_account / "token").write_text("rotated")
        assert kube.counts()[Role.DECODE] == 2

    def test_the_servers_certificate_must_be_the_clusters(self, api: FakeKubernetesApi, service_account: Path,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
        other = tmp_path_factory.mktemp("other-ca")
        write_certificates(other, ["127.0.0.1"], [])
        (service_account / "ca.crt").write_bytes((other / "ca.pem").read_bytes())
        environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": api.url.rsplit(":", 1)[1]}
        with pytest.raises(KubernetesApiError, match="CERTIFICATE_VERIFY_FAILED"):
            KubernetesActuator.in_cluster(ENGINE_WORKLOADS, service_account=service_account, environ=environ).counts()

    def test_outside_a_pod_it_says_so(self, service_account: Path) -> None:
        with pytest.raises(RuntimeError, match="KUBERNETES_SERVICE_HOST"):
            KubernetesActuator.in_cluster(ENGINE_WORKLOADS, service_account=service_account, environ={})


class TestThePlannerService:
    def test_kubernetes_is_an_actuator_it_builds_and_outside_a_pod_it_says_why_not(self) -> None:
        from halfmoon.services.planner.service import ACTUATORS, PlannerServiceConfig

        config = PlannerServiceConfig(actuator="kubernetes", nats_url="nats://127.0.0.1:4222")
        with pytest.raises(RuntimeError, match="KUBERNETES_SERVICE_HOST"):
            ACTUATORS[config.actuator](config)
