"""Settings that only work together are validated together: a setting that would do nothing, or a pair
set by halves, stops the service at start with a message naming the variables to fix."""

from __future__ import annotations

from typing import Any

import pytest

from halfmoon.policy.state import SERVING_SLO
from halfmoon.runtime import ServiceConfig, load_config
from halfmoon.runtime.data_plane import DataPlaneConfig
from halfmoon.runtime.worker import WorkerConfig
from halfmoon.services.conductor.service import ConductorConfig
from halfmoon.services.gateway.service import GatewayConfig
from halfmoon.services.transfer.service import TransferConfig

WORKER = {"HALFMOON_MODEL_DIR": "/m"}


def refusal(cls: type[Any], env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> str:
    """The usage error ``load_config`` exits with for ``env``."""
    with pytest.raises(SystemExit) as info:
        load_config(cls, [], env=env)
    assert info.value.code == 2
    return capsys.readouterr().err


class TestTbtSlo:
    def test_chunking_alone_sizes_steps_to_the_slo_the_conductor_admits_to(self):
        env = {**WORKER, "HALFMOON_TBT_CHUNKING": "1"}
        target = load_config(WorkerConfig, [], env=env).engine_config().step_time_target_s
        assert target == load_config(ConductorConfig, [], env=env).tbt_slo_s == SERVING_SLO.tbt_s > 0

    @pytest.mark.parametrize("slo", ["0", "-0.1", "nan"])
    def test_chunking_without_a_positive_slo_is_refused_naming_both(self, slo, capsys):
        err = refusal(WorkerConfig, {**WORKER, "HALFMOON_TBT_CHUNKING": "1", "HALFMOON_TBT_SLO_S": slo}, capsys)
        assert "HALFMOON_TBT_CHUNKING" in err and "HALFMOON_TBT_SLO_S" in err

    def test_a_zero_slo_without_chunking_leaves_the_engine_untargeted(self):
        config = load_config(WorkerConfig, [], env={**WORKER, "HALFMOON_TBT_SLO_S": "0"})
        assert config.engine_config().step_time_target_s == 0.0


class TestServicePairs:
    @pytest.mark.parametrize(("env", "names"), [
        ({"HALFMOON_NATS_USER": "prefill"}, ["HALFMOON_NATS_USER", "HALFMOON_NATS_PASSWORD"]),
        ({"HALFMOON_NATS_TLS_CERT": "/c.pem"}, ["HALFMOON_NATS_TLS_CERT", "HALFMOON_NATS_TLS_KEY"]),
        ({"HALFMOON_NATS_TLS_CERT": "/c.pem", "HALFMOON_NATS_TLS_KEY": "/k.pem"},
         ["HALFMOON_NATS_TLS_CERT", "HALFMOON_NATS_TLS_CA"]),
        ({"HALFMOON_METRICS_HOST": "0.0.0.0"}, ["HALFMOON_METRICS_HOST", "HALFMOON_METRICS_PORT"]),
        ({"HALFMOON_CLUSTER_SECRET": "s" * 32, "HALFMOON_CLUSTER_SECRET_FILE": "/secret"},
         ["HALFMOON_CLUSTER_SECRET", "HALFMOON_CLUSTER_SECRET_FILE"]),
    ])
    def test_halves_are_refused(self, env, names, capsys):
        err = refusal(ServiceConfig, env, capsys)
        assert all(name in err for name in names), err

    def test_metrics_host_with_a_port_is_taken(self):
        env = {"HALFMOON_METRICS_HOST": "0.0.0.0", "HALFMOON_METRICS_PORT": "9464"}
        assert load_config(ServiceConfig, [], env=env).metrics_host == "0.0.0.0"


class TestDataPlanePairs:
    @pytest.mark.parametrize(("env", "names"), [
        ({"HALFMOON_RDMA_DEVICE": "mlx5_0"}, ["HALFMOON_RDMA_DEVICE", "HALFMOON_DATA_PATHS"]),
        ({"HALFMOON_DATA_HOST": "10.0.0.2"}, ["HALFMOON_DATA_HOST", "HALFMOON_DATA_PATHS"]),
        ({"HALFMOON_MOONCAKE_PROTOCOL": "rdma"}, ["HALFMOON_MOONCAKE_PROTOCOL", "HALFMOON_DATA_PATHS"]),
        ({"HALFMOON_DATA_PATHS": "mooncake", "HALFMOON_MOONCAKE_DEVICE": "mlx5_0"},
         ["HALFMOON_MOONCAKE_DEVICE", "HALFMOON_MOONCAKE_PROTOCOL"]),
    ])
    def test_settings_of_a_path_not_used_are_refused(self, env, names, capsys):
        err = refusal(DataPlaneConfig, env, capsys)
        assert all(name in err for name in names), err

    def test_settings_of_the_paths_used_are_taken(self):
        env = {"HALFMOON_DATA_PATHS": "mooncake,rdma", "HALFMOON_MOONCAKE_PROTOCOL": "rdma",
               "HALFMOON_MOONCAKE_DEVICE": "mlx5_0", "HALFMOON_RDMA_DEVICE": "mlx5_1", "HALFMOON_DATA_HOST": "10.0.0.2"}
        config = load_config(DataPlaneConfig, [], env=env)
        assert (config.mooncake_device, config.rdma_device, config.data_host) == ("mlx5_0", "mlx5_1", "10.0.0.2")


class TestTransferTiers:
    @pytest.mark.parametrize(("env", "names"), [
        ({"HALFMOON_NVME_BYTES": str(1 << 30)}, ["HALFMOON_NVME_BYTES", "HALFMOON_NVME_DIR"]),
        ({"HALFMOON_S3_BUCKET": "kv"}, ["HALFMOON_S3_BUCKET", "HALFMOON_S3_ENDPOINT"]),
        ({"HALFMOON_S3_ACCESS_KEY": "a", "HALFMOON_S3_SECRET_KEY": "b"},
         ["HALFMOON_S3_ACCESS_KEY", "HALFMOON_S3_SECRET_KEY", "HALFMOON_S3_ENDPOINT"]),
        ({"HALFMOON_S3_ENDPOINT": "http://s3:8333", "HALFMOON_S3_SECRET_KEY": ""},
         ["HALFMOON_S3_ACCESS_KEY", "HALFMOON_S3_SECRET_KEY"]),
    ])
    def test_tier_settings_by_halves_are_refused(self, env, names, capsys):
        err = refusal(TransferConfig, env, capsys)
        assert all(name in err for name in names), err

    def test_a_bad_endpoint_fails_at_config_not_at_start(self, capsys):
        assert "endpoint_url" in refusal(TransferConfig, {"HALFMOON_S3_ENDPOINT": "s3:8333"}, capsys)

    def test_whole_tiers_are_taken(self, tmp_path):
        env = {"HALFMOON_NVME_DIR": str(tmp_path), "HALFMOON_NVME_BYTES": str(1 << 30),
               "HALFMOON_S3_ENDPOINT": "http://s3:8333", "HALFMOON_S3_BUCKET": "kv"}
        config = load_config(TransferConfig, [], env=env)
        assert (config.nvme_bytes, config.s3_config().bucket) == (1 << 30, "kv")


class TestGatewayAuth:
    def test_insecure_flag_beside_api_keys_is_refused(self, tmp_path, capsys):
        env = {"HALFMOON_MODEL_DIR": "/m", "HALFMOON_API_KEYS_FILE": str(tmp_path / "keys"),
               "HALFMOON_INSECURE_NO_AUTH": "1"}
        err = refusal(GatewayConfig, env, capsys)
        assert "HALFMOON_INSECURE_NO_AUTH" in err and "HALFMOON_API_KEYS_FILE" in err


class TestConductorPolicy:
    @pytest.mark.parametrize(("env", "names"), [
        ({"HALFMOON_CPP_MIN_TOKENS": "64"}, ["HALFMOON_CPP_MIN_TOKENS", "HALFMOON_CPP_STAGES"]),
        ({"HALFMOON_CPP_RESCUE_ONLY": "0"}, ["HALFMOON_CPP_RESCUE_ONLY", "HALFMOON_CPP_STAGES"]),
        ({"HALFMOON_PLACEMENT": "least-loaded", "HALFMOON_ADMISSION": "none"},
         ["HALFMOON_ADMISSION", "HALFMOON_PLACEMENT"]),
        ({"HALFMOON_PLACEMENT": "least-loaded", "HALFMOON_CPP_STAGES": "2"},
         ["HALFMOON_CPP_STAGES", "HALFMOON_PLACEMENT"]),
    ])
    def test_policy_settings_the_policy_ignores_are_refused(self, env, names, capsys):
        err = refusal(ConductorConfig, env, capsys)
        assert all(name in err for name in names), err

    def test_pipeline_settings_with_stages_are_taken(self):
        env = {"HALFMOON_CPP_STAGES": "2", "HALFMOON_CPP_MIN_TOKENS": "64", "HALFMOON_CPP_RESCUE_ONLY": "0"}
        config = load_config(ConductorConfig, [], env=env)
        assert (config.cpp_settings().min_tokens, config.cpp_settings().min_single_ttft_s) == (64, 0.0)


class TestEngineChoice:
    def test_the_engine_is_halfmoons_unless_vllm_is_asked_for(self):
        assert load_config(WorkerConfig, [], env=WORKER).engine == "halfmoon"
        assert load_config(WorkerConfig, [], env={**WORKER, "HALFMOON_ENGINE": "vllm"}).engine == "vllm"

    def test_an_unknown_engine_is_refused_naming_the_choices(self, capsys):
        err = refusal(WorkerConfig, {**WORKER, "HALFMOON_ENGINE": "sglang"}, capsys)
        assert "HALFMOON_ENGINE" in err and "halfmoon, vllm" in err

    def test_vllm_arguments_need_the_vllm_engine(self, capsys):
        err = refusal(WorkerConfig, {**WORKER, "HALFMOON_VLLM_ARGS": '{"enforce_eager": true}'}, capsys)
        assert "HALFMOON_VLLM_ARGS" in err and "HALFMOON_ENGINE=vllm" in err

    @pytest.mark.parametrize("args", ["{enforce_eager}", "[1, 2]"])
    def test_vllm_arguments_are_a_json_object(self, args, capsys):
        err = refusal(WorkerConfig, {**WORKER, "HALFMOON_ENGINE": "vllm", "HALFMOON_VLLM_ARGS": args}, capsys)
        assert "HALFMOON_VLLM_ARGS" in err

    def test_vllm_arguments_reach_the_engine_as_given(self):
        env = {**WORKER, "HALFMOON_ENGINE": "vllm", "HALFMOON_VLLM_ARGS": '{"enforce_eager": true, "seed": 3}'}
        assert load_config(WorkerConfig, [], env=env).extra_vllm_args() == {"enforce_eager": True, "seed": 3}

    def test_tbt_chunking_is_halfmoons_engines_and_refused_with_vllm(self, capsys):
        err = refusal(WorkerConfig, {**WORKER, "HALFMOON_ENGINE": "vllm", "HALFMOON_TBT_CHUNKING": "1"}, capsys)
        assert "HALFMOON_TBT_CHUNKING" in err and "HALFMOON_ENGINE=vllm" in err
