"""`halfmoon up --planner`'s settings: what it refuses before anything starts, and where its SLOs come from."""

import pytest

from halfmoon.cli.main import build_parser
from halfmoon.cli.up import planner_config

AGGREGATED = {"prefill": 0, "decode": 0, "aggregated": 1}


def args(*flags: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["up", "--planner", *flags])


class TestPlannerSettings:
    def test_slos_are_the_conductors_unless_given(self):
        config = planner_config(args(), {"HALFMOON_TBT_SLO_S": "0.15", "HALFMOON_TTFT_SLO_S": "4"}, AGGREGATED)
        assert (config.ttft_slo_s, config.tbt_slo_s) == (4.0, 0.15)
        config = planner_config(args("--planner-tbt-slo", "0.1"), {"HALFMOON_TBT_SLO_S": "60"}, AGGREGATED)
        assert config.tbt_slo_s == 0.1

    def test_flags_reach_the_config(self):
        config = planner_config(args("--planner-interval", "2", "--planner-max-instances", "3"), {}, AGGREGATED)
        assert (config.interval_s, config.max_instances) == (2.0, 3)

    @pytest.mark.parametrize(("flags", "counts", "message"), [
        (("--pool-only",), AGGREGATED, "--pool-only runs none"),
        ((), {"prefill": 1, "decode": 1, "aggregated": 1}, "not both at once"),
        (("--planner-profile", "no-such-profile"), AGGREGATED, "no profile at"),
        (("--planner-max-instances", "1"), AGGREGATED, "max_instances must be >= 2"),
    ])
    def test_refuses_what_it_cannot_plan(self, flags, counts, message):
        with pytest.raises(SystemExit, match=message):
            planner_config(args(*flags), {}, counts)
