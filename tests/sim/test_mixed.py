"""The mixed layout: the simulator hands each request off or serves it whole by the Conductor's policy."""

import dataclasses

import pytest

from halfmoon.policy.state import SLO
from halfmoon.sim.config import SimConfig, SimConfigError
from halfmoon.sim.metrics import OK
from halfmoon.sim.run import simulate
from halfmoon.sim.trace import TraceRequest

MIXED = SimConfig(mode="mixed", prefill_nodes=1, decode_nodes=1, aggregated_nodes=1, slo=SLO(30.0, 0.1),
                  handoff_overhead_s=0.05)


def test_short_and_cached_prompts_are_served_whole_and_a_long_uncached_one_handed_off(profile):
    # With the 70B profile (20 ms + 86 us a prompt token), beside one decoding sequence serving whole costs
    # twice the prefill, the hand-off the prefill plus the KV's transfer plus 50 ms.
    trace = [
        TraceRequest(0.0, 1024, 3000, (1, 2)),  # an idle deployment: whole; then decodes for a minute
        TraceRequest(5.0, 100, 5, (3,)),  # short: 2 x 29 ms against 29 + 50 ms
        TraceRequest(10.0, 8000, 5, tuple(range(10, 26))),  # long and uncached: 2 x 0.83 s against 0.88 s
        TraceRequest(15.0, 1100, 5, (1, 2, 3)),  # 1,024 tokens cached on the aggregated node: whole
    ]
    result = simulate(MIXED, profile, trace)
    assert (result.outcomes.status == OK).all()
    assert result.whole is not None and result.whole.tolist() == [True, True, False, True]
    assert result.outcomes.hit_blocks[3] == 2


def test_the_choice_follows_the_hand_off_cost(profile):
    # 600 tokens beside a batch of one: whole 2 x 72 ms; handed off 72 ms + 3 ms of KV + the overhead
    short_beside_a_batch = [TraceRequest(0.0, 1024, 3000, (1, 2)), TraceRequest(5.0, 600, 5, (3, 4))]
    cheap = simulate(MIXED, profile, short_beside_a_batch)
    dear = simulate(dataclasses.replace(MIXED, handoff_overhead_s=1.0), profile, short_beside_a_batch)
    assert cheap.whole is not None and cheap.whole.tolist() == [True, False]
    assert dear.whole is not None and dear.whole.tolist() == [True, True]


@pytest.mark.parametrize("mode, aggregated", [("mixed", 0), ("disaggregated", 1), ("coupled", 1)])
def test_aggregated_nodes_belong_to_the_mixed_mode(mode, aggregated):
    with pytest.raises(SimConfigError, match="aggregated_nodes"):
        SimConfig(mode=mode, prefill_nodes=1, decode_nodes=1, aggregated_nodes=aggregated)
