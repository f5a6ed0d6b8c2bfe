"""Service config: defaults, HALFMOON_* environment, flags on top, and clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from halfmoon.runtime import ServiceConfig, load_config
from halfmoon.runtime.worker import WorkerConfig
from halfmoon.services.conductor.service import ConductorConfig


@dataclass(frozen=True)
class DemoConfig(ServiceConfig):
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    ratio: float = 0.5
    verbose: bool = False
    model_dir: str | None = None


class TestPrecedence:
    def test_defaults_run_on_one_machine(self):
        config = load_config(DemoConfig, [], env={})
        assert (config.nats_url, config.namespace, config.port) == ("nats://127.0.0.1:4222", "halfmoon", 8000)
        assert config.model_dir is None and config.verbose is False

    def test_env_then_flags(self):
        env = {
            "HALFMOON_PORT": "9000",
            "HALFMOON_NAMESPACE": "blue",
            "HALFMOON_VERBOSE": "yes",
            "HALFMOON_MODEL_DIR": "/m",
        }
        config = load_config(DemoConfig, ["--port", "9100", "--no-verbose"], env=env)
        assert (config.port, config.namespace, config.verbose, config.model_dir) == (9100, "blue", False, "/m")
        assert config.subjects.schedule == "blue.v1.conductor.schedule"

    def test_unrelated_env_is_ignored(self):
        assert load_config(DemoConfig, [], env={"PORT": "1", "HALFMOON_OTHER": "x"}).port == 8000


class TestErrors:
    @pytest.mark.parametrize(
        ("argv", "env", "needle"),
        [
            (["--port", "eighty"], {}, "--port: cannot read 'eighty' as int"),
            ([], {"HALFMOON_RATIO": "half"}, "HALFMOON_RATIO: cannot read 'half' as float"),
            ([], {"HALFMOON_VERBOSE": "maybe"}, "HALFMOON_VERBOSE"),
            (["--namespace", "a.*"], {}, "namespace"),
            (["--heartbeat-interval-s", "0"], {}, "heartbeat_interval_s must be > 0"),
            (["--instance-id", "has.dot"], {}, "instance_id"),
            (["--log-format", "xml"], {}, "log_format"),
            (["--no-such-flag"], {}, "unrecognized arguments"),
        ],
    )
    def test_bad_values_exit_with_a_clear_message(self, argv, env, needle, capsys):
        with pytest.raises(SystemExit) as info:
            load_config(DemoConfig, argv, env=env)
        assert info.value.code == 2
        assert needle in capsys.readouterr().err


class TestOneTbtSlo:
    """HALFMOON_TBT_SLO_S is the conductor's admission SLO and, with TBT chunking, the engines' step target."""

    def test_one_variable_reaches_both(self):
        env = {"HALFMOON_TBT_SLO_S": "0.3", "HALFMOON_MODEL_DIR": "/m", "HALFMOON_TBT_CHUNKING": "true"}
        assert load_config(ConductorConfig, [], env=env).tbt_slo_s == 0.3
        assert load_config(WorkerConfig, [], env=env).engine_config().step_time_target_s == 0.3

    def test_engines_keep_no_target_unless_chunking_is_asked_for(self):
        env = {"HALFMOON_TBT_SLO_S": "0.3", "HALFMOON_MODEL_DIR": "/m"}
        assert load_config(WorkerConfig, [], env=env).engine_config().step_time_target_s == 0.0
