"""`halfmoon up`'s engine instance counts: disaggregated by default on 4 cores or more, one aggregated engine
below, either on request."""

from __future__ import annotations

import sys

import pytest

from halfmoon.cli.up import check_vllm, engine_counts, layout_hint, shape, user_settings
from halfmoon.deploy.local import LocalCluster
from halfmoon.deploy.processes import core_share
from halfmoon.deploy.topology import instances


class TestEngineCounts:
    def test_default_is_one_prefill_one_decode_given_two_cores_each(self):
        assert engine_counts(None, None, None, cores=4) == {"prefill": 1, "decode": 1, "aggregated": 0}

    def test_a_smaller_machine_gets_one_aggregated_engine_unless_a_layout_is_asked_for(self):
        assert engine_counts(None, None, None, cores=2) == {"prefill": 0, "decode": 0, "aggregated": 1}
        assert engine_counts(1, 1, None, cores=2) == {"prefill": 1, "decode": 1, "aggregated": 0}
        assert engine_counts(None, None, 0, cores=2) == {"prefill": 1, "decode": 1, "aggregated": 0}

    def test_aggregated_alone_unless_prefill_or_decode_are_asked_for(self):
        assert engine_counts(None, None, 2) == {"prefill": 0, "decode": 0, "aggregated": 2}
        assert engine_counts(1, 1, 1) == {"prefill": 1, "decode": 1, "aggregated": 1}
        assert shape(engine_counts(None, None, 2)) == "2 aggregated"

    @pytest.mark.parametrize(("prefill", "decode", "aggregated"), [(0, 1, 0), (1, 0, 0), (-1, 1, 1)])
    def test_a_deployment_that_cannot_serve_is_refused(self, prefill, decode, aggregated):
        with pytest.raises(SystemExit):
            engine_counts(prefill, decode, aggregated)

    def test_aggregated_instances_run_only_when_asked_for(self):
        assert not [iid for _, iid in instances({}) if iid.startswith("aggregated")]
        plan = [iid for _, iid in instances({"prefill": 0, "decode": 0, "aggregated": 2})]
        assert "aggregated-1" in plan and not [iid for iid in plan if iid.startswith(("prefill", "decode"))]


class TestLayoutHint:
    def test_two_cores_split_between_prefill_and_decode_are_told_to_aggregate(self):
        hint = layout_hint(2, engine_counts(1, 1, 0))
        assert hint is not None and "--aggregated 1" in hint

    def test_the_small_machines_default_says_why_and_how_to_disaggregate(self):
        hint = layout_hint(2, engine_counts(None, None, None, cores=2))
        assert hint is not None and "--prefill 1 --decode 1" in hint

    def test_enough_cores_per_engine_get_no_hint(self):
        assert layout_hint(4, engine_counts(1, 1, 0)) is None
        assert layout_hint(4, engine_counts(None, None, 1)) is None


class TestUserSettings:
    def test_the_callers_settings_reach_every_instance_but_per_instance_ones_stay_the_launchers(self, tmp_path):
        environ = {"HALFMOON_DTYPE": "float32", "HALFMOON_TTFT_SLO_S": "5", "HALFMOON_INSTANCE_ID": "mine",
                   "HALFMOON_READY_FILE": "/tmp/x", "HALFMOON_METRICS_PORT": "9100", "HOME": "/root"}
        settings = user_settings(environ)
        assert "HOME" not in settings
        cluster = LocalCluster(tmp_path / "model", tmp_path / "run", {"prefill": 2, "decode": 1},
                               metrics=True, env=settings)
        envs = [cluster.env_for(spec, iid) for spec, iid in cluster.plan]
        for (spec, iid), env in zip(cluster.plan, envs):
            assert env["HALFMOON_DTYPE"] == "float32" and env["HALFMOON_TTFT_SLO_S"] == "5"
            assert env["HALFMOON_INSTANCE_ID"] == iid
            assert env["HALFMOON_READY_FILE"] == str(cluster.ready_file(iid))
            assert env.get("HALFMOON_METRICS_PORT") != "9100", spec.name
        assert len({env["HALFMOON_INSTANCE_ID"] for env in envs}) == len(envs)


class TestVllmEngines:
    def test_each_vllm_engine_gets_its_own_share_of_the_cores(self, tmp_path, monkeypatch):
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        monkeypatch.setattr("os.cpu_count", lambda: 4)
        cluster = LocalCluster(tmp_path / "model", tmp_path / "run", {"prefill": 1, "decode": 2},
                               env={"HALFMOON_ENGINE": "vllm"}, engine_python="/venv/bin/python")
        binds = {iid: cluster.env_for(spec, iid).get("VLLM_CPU_OMP_THREADS_BIND") for spec, iid in cluster.plan}
        assert binds["prefill-0"] == "0-0" and binds["decode-0"] == "1-1" and binds["decode-1"] == "2-3"
        assert binds["gateway-0"] is None and cluster.engine_python == "/venv/bin/python"

    def test_halfmoons_engines_and_one_vllm_engine_are_left_to_bind_themselves(self, tmp_path, monkeypatch):
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        for env, counts in (({}, {"prefill": 1, "decode": 1}), ({"HALFMOON_ENGINE": "vllm"}, {"prefill": 0, "decode": 0, "aggregated": 1})):
            cluster = LocalCluster(tmp_path / "model", tmp_path / "run", counts, env=env)
            assert all("VLLM_CPU_OMP_THREADS_BIND" not in cluster.env_for(spec, iid) for spec, iid in cluster.plan)

    @pytest.mark.parametrize(("count", "cores", "shares"), [(2, 2, ["0-0", "1-1"]), (3, 2, ["0", "1", "0"]),
                                                             (2, 5, ["0-1", "2-4"])])
    def test_core_shares_split_evenly_or_round_robin(self, count, cores, shares):
        assert [core_share(i, count, cores) for i in range(count)] == shares

    def test_an_interpreter_without_vllm_stops_up_before_anything_starts(self):
        with pytest.raises(SystemExit) as info:
            check_vllm(sys.executable)  # the test venv has no vLLM
        assert "cannot import vllm" in str(info.value) and "halfmoon[vllm]" in str(info.value)
