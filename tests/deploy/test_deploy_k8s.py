"""infra/k8s: renders with kustomize, validates against the Kubernetes schemas offline (the
kubernetes-validate wheel ships them), and runs the same services as `halfmoon up`."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from halfmoon.deploy.kubernetes_actuator import ENGINE_WORKLOADS
from halfmoon.deploy.planner import ENGINE_ROLES
from halfmoon.deploy.topology import SERVICES
from halfmoon.runtime.config import ENV_PREFIX, ServiceConfig
from tests.conftest import REPO_ROOT
from tests.deploy.conftest import K8S_VERSION, workloads

GPU = "nvidia.com/gpu"


def container(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def env(workload: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(workload).get("env", [])}


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


class TestSchemas:
    @pytest.mark.parametrize("docs", ["k8s_base", "k8s_gpu", "k8s_planner", "k8s_vllm"])
    def test_every_resource_validates_strictly(self, docs: str, request: pytest.FixtureRequest) -> None:
        resources = request.getfixturevalue(docs)
        assert len(resources) > 10
        for doc in resources:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)

    def test_validation_catches_mistakes(self, k8s_base: list[dict[str, Any]]) -> None:
        deployment = copy.deepcopy(workloads(k8s_base)["prefill"])
        container(deployment)["resources"]["requests"]["cpu"] = ["2"]
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
        deployment = copy.deepcopy(workloads(k8s_base)["prefill"])
        container(deployment)["argz"] = ["python"]
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


class TestSameServicesAsHalfmoonUp:
    def test_every_topology_service_runs_its_command(self, k8s_base: list[dict[str, Any]]) -> None:
        found = workloads(k8s_base)
        for spec in SERVICES:
            assert container(found[spec.name])["args"] == spec.command
            assert "command" not in container(found[spec.name]), "keep the image's entrypoint"

    def test_the_jetstream_buckets_are_made_by_a_one_shot_job_as_in_compose(
            self, k8s_base: list[dict[str, Any]], compose: dict[str, Any]) -> None:
        jobs = {d["metadata"]["name"]: d for d in k8s_base if d["kind"] == "Job"}
        assert container(jobs["jetstream"])["args"] == compose["services"]["jetstream"]["command"]
        assert jobs["jetstream"]["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"

    def test_each_has_a_service_or_needs_none(self, k8s_base: list[dict[str, Any]]) -> None:
        services = {d["metadata"]["name"] for d in k8s_base if d["kind"] == "Service"}
        assert {"gateway", "transfer", "nats", "nats-headless", "s3", "jaeger"} <= services


class TestResources:
    def test_every_container_requests_cpu_and_memory(self, k8s_base: list[dict[str, Any]]) -> None:
        for name, workload in workloads(k8s_base).items():
            requests = container(workload)["resources"]["requests"]
            assert {"cpu", "memory"} <= set(requests), name

    def test_gpus_only_in_the_gpu_overlay_and_only_for_workers(
        self, k8s_base: list[dict[str, Any]], k8s_gpu: list[dict[str, Any]]
    ) -> None:
        for workload in workloads(k8s_base).values():
            assert GPU not in container(workload)["resources"].get("limits", {})
        with_gpu = {
            name for name, w in workloads(k8s_gpu).items() if GPU in container(w)["resources"].get("limits", {})
        }
        assert with_gpu == {"prefill", "decode"}
        for name in with_gpu:
            assert env(workloads(k8s_gpu)[name])["HALFMOON_DEVICE"] == "cuda"
            assert env(workloads(k8s_base)[name])["HALFMOON_DEVICE"] == "cpu"

    def test_vllm_engines_only_in_the_vllm_overlay_with_a_memory_backed_dev_shm(
        self, k8s_base: list[dict[str, Any]], k8s_vllm: list[dict[str, Any]]
    ) -> None:
        assert all("HALFMOON_ENGINE" not in env(w) for w in workloads(k8s_base).values())
        on_vllm = {name for name, w in workloads(k8s_vllm).items() if env(w).get("HALFMOON_ENGINE") == "vllm"}
        assert on_vllm == {"prefill", "decode"}
        for name in on_vllm:
            spec = workloads(k8s_vllm)[name]["spec"]["template"]["spec"]
            volume = next(v for v in spec["volumes"] if v["name"] == "dshm")
            assert volume["emptyDir"]["medium"] == "Memory"
            assert {"name": "dshm", "mountPath": "/dev/shm"} in container(workloads(k8s_vllm)[name])["volumeMounts"]
        images = {container(w)["image"] for w in workloads(k8s_vllm).values() if container(w)["image"].startswith("halfmoon")}
        assert images == {"halfmoon:vllm"}, "one image for every service, built with the vllm extra"

    def test_dram_segment_fits_its_memory_backed_dev_shm(self, k8s_base: list[dict[str, Any]]) -> None:
        transfer = workloads(k8s_base)["transfer"]
        volume = next(v for v in transfer["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
        assert volume["emptyDir"]["medium"] == "Memory"
        assert int(volume["emptyDir"]["sizeLimit"].removesuffix("Mi")) << 20 >= int(
            env(transfer)["HALFMOON_DRAM_BYTES"]
        )


class TestTopology:
    def test_nats_is_a_jetstream_cluster_of_three(self, k8s_base: list[dict[str, Any]]) -> None:
        nats = workloads(k8s_base)["nats"]
        assert nats["kind"] == "StatefulSet" and nats["spec"]["replicas"] == 3
        conf = next(d for d in k8s_base if d["metadata"]["name"] == "nats-config")["data"]["nats.conf"]
        assert "jetstream" in conf and all(f"nats-{i}.nats-headless:6222" in conf for i in range(3))

    def test_transfer_nodes_advertise_their_pod_ip_and_keep_their_nvme(self, k8s_base: list[dict[str, Any]]) -> None:
        transfer = workloads(k8s_base)["transfer"]
        assert env(transfer)["HALFMOON_HOST"] == "0.0.0.0"
        assert env(transfer)["HALFMOON_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        claims = {c["metadata"]["name"] for c in transfer["spec"]["volumeClaimTemplates"]}
        mounts = {m["name"]: m["mountPath"] for m in container(transfer)["volumeMounts"]}
        assert "nvme" in claims and mounts["nvme"] == env(transfer)["HALFMOON_NVME_DIR"]

    def test_scaled_services_set_no_instance_id(self, k8s_base: list[dict[str, Any]]) -> None:
        config = next(d for d in k8s_base if d["metadata"]["name"] == "halfmoon-env")["data"]
        assert "HALFMOON_INSTANCE_ID" not in config
        for spec in SERVICES:
            assert "HALFMOON_INSTANCE_ID" not in env(workloads(k8s_base)[spec.name])

    def test_halfmoon_pods_run_as_the_image_user_and_can_write_their_volumes(
        self, k8s_base: list[dict[str, Any]]
    ) -> None:
        dockerfile = (REPO_ROOT / "infra" / "Dockerfile").read_text()
        uid = int(next(line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")))
        for spec in SERVICES:
            context = workloads(k8s_base)[spec.name]["spec"]["template"]["spec"]["securityContext"]
            assert context["runAsUser"] == uid and context["fsGroup"] == uid, spec.name


class TestSecrets:
    """No credential in the manifests: one Secret, `halfmoon-secrets`, made from `halfmoon secrets DIR`
    by the operator, mounted where each part reads it."""

    def test_no_secret_object_carries_data(self, k8s_base: list[dict[str, Any]]) -> None:
        assert not [d["metadata"]["name"] for d in k8s_base if d["kind"] == "Secret"]

    def test_every_service_mounts_it_read_only_for_the_image_user(self, k8s_base: list[dict[str, Any]]) -> None:
        config = next(d for d in k8s_base if d["metadata"]["name"] == "halfmoon-env")["data"]
        for spec in SERVICES:
            pod = workloads(k8s_base)[spec.name]["spec"]["template"]["spec"]
            volume = next(v for v in pod["volumes"] if v["name"] == "secrets")
            assert volume["secret"]["secretName"] == "halfmoon-secrets"
            assert volume["secret"]["defaultMode"] & 0o040, "group-readable (fsGroup is the image's user)"
            mount = next(m for m in container(workloads(k8s_base)[spec.name])["volumeMounts"] if m["name"] == "secrets")
            assert mount["mountPath"] == config["HALFMOON_SECRETS_DIR"] and mount["readOnly"]

    def test_nats_and_s3_read_their_parts(self, k8s_base: list[dict[str, Any]]) -> None:
        nats_conf = next(d for d in k8s_base if d["metadata"]["name"] == "nats-config")["data"]["nats.conf"]
        assert "include ./auth/nats-authorization.conf" in nats_conf
        for name, key in (("nats", "nats-authorization.conf"), ("s3", "s3.json")):
            volumes = workloads(k8s_base)[name]["spec"]["template"]["spec"]["volumes"]
            assert any(v.get("secret", {}).get("secretName") == "halfmoon-secrets"
                       and [i["key"] for i in v["secret"]["items"]] == [key] for v in volumes), name


class TestNoSinglePointOfFailure:
    @pytest.mark.parametrize("name", ["conductor", "cache-manager"])
    def test_two_of_each_control_service(self, k8s_base: list[dict[str, Any]], name: str) -> None:
        spec = workloads(k8s_base)[name]["spec"]
        assert spec["replicas"] >= 2 and spec.get("strategy", {}).get("type") != "Recreate"


class TestDrainOnScaleDown:
    def test_the_engines_grace_period_outlasts_their_drain(self, k8s_base: list[dict[str, Any]]) -> None:
        """The kubelet kills a pod its grace period after SIGTERM: an engine must have finished draining."""
        config = named(k8s_base, "ConfigMap", "halfmoon-env")["data"]
        variable = f"{ENV_PREFIX}DRAIN_TIMEOUT_S"
        for reference in ENGINE_WORKLOADS.values():
            workload = workloads(k8s_base)[reference.split("/")[1]]
            drain_s = float(env(workload).get(variable) or config.get(variable) or ServiceConfig().drain_timeout_s)
            assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_s, reference


class TestPlannerOverlay:
    """infra/k8s/overlays/planner: the base, unchanged, plus a planner allowed to set the engines' replicas
    and nothing else."""

    def test_the_base_is_in_it_unchanged(self, k8s_base: list[dict[str, Any]],
                                         k8s_planner: list[dict[str, Any]]) -> None:
        for doc in k8s_base:
            assert named(k8s_planner, doc["kind"], doc["metadata"]["name"]) == doc
        added = {(d["kind"], d["metadata"]["name"]) for d in k8s_planner} - {
            (d["kind"], d["metadata"]["name"]) for d in k8s_base}
        assert added == {("ServiceAccount", "planner"), ("Role", "planner"), ("RoleBinding", "planner"),
                         ("Deployment", "planner")}

    def test_the_engine_workloads_the_actuator_scales_are_the_bases(self, k8s_base: list[dict[str, Any]]) -> None:
        modules = {f"halfmoon.services.{role.value}" for role in ENGINE_ROLES}
        engines = {name: w["kind"] for name, w in workloads(k8s_base).items()
                   if modules & set(container(w).get("args", []))}
        assert {f"{kind.lower()}/{name}" for name, kind in engines.items()} == set(ENGINE_WORKLOADS.values())

    def test_its_role_grants_exactly_get_and_patch_of_the_engines_scale(
            self, k8s_planner: list[dict[str, Any]]) -> None:
        assert not [d for d in k8s_planner if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
        (rule,) = named(k8s_planner, "Role", "planner")["rules"]
        plural = {kind: f"{kind}s/scale" for kind in ("deployment", "statefulset")}
        assert rule["apiGroups"] == ["apps"]
        assert {(resource, name) for resource in rule["resources"] for name in rule["resourceNames"]} == {
            (plural[kind], name) for kind, name in (r.split("/") for r in ENGINE_WORKLOADS.values())}
        assert sorted(rule["verbs"]) == ["get", "patch"]

    def test_the_planner_alone_runs_as_the_bound_service_account(self, k8s_planner: list[dict[str, Any]]) -> None:
        account = named(k8s_planner, "ServiceAccount", "planner")
        binding = named(k8s_planner, "RoleBinding", "planner")
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "planner"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "planner",
                                        "namespace": account["metadata"]["namespace"]}]
        assert {d["metadata"]["namespace"] for d in (account, binding, named(k8s_planner, "Role", "planner"))} == {
            named(k8s_planner, "Deployment", "prefill")["metadata"]["namespace"]}
        runs_as = {name: w["spec"]["template"]["spec"].get("serviceAccountName") for name, w in
                   workloads(k8s_planner).items()}
        assert {name for name, account_name in runs_as.items() if account_name == "planner"} == {"planner"}
        assert named(k8s_planner, "Deployment", "planner")["spec"]["template"]["spec"][
            "automountServiceAccountToken"] is True

    def test_the_planner_runs_the_kubernetes_actuator_with_the_operators_nats_user(
            self, k8s_planner: list[dict[str, Any]]) -> None:
        planner = named(k8s_planner, "Deployment", "planner")
        assert container(planner)["args"] == ["python", "-m", "halfmoon.services.planner"]
        assert container(planner)["image"] == container(named(k8s_planner, "Deployment", "decode"))["image"]
        assert env(planner)["HALFMOON_ACTUATOR"] == "kubernetes"
        assert "HALFMOON_SECRETS_ROLE" not in env(planner)  # the entrypoint loads planner.env: NATS as the planner
        pod = planner["spec"]["template"]["spec"]
        assert next(v for v in pod["volumes"] if v["name"] == "secrets")["secret"]["secretName"] == "halfmoon-secrets"
        assert container(planner)["envFrom"] == [{"configMapRef": {"name": "halfmoon-env"}}]

    def test_one_planner_at_a_time(self, k8s_planner: list[dict[str, Any]]) -> None:
        spec = named(k8s_planner, "Deployment", "planner")["spec"]
        assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
