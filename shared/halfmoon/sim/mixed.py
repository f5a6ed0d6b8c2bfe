"""The mixed layout: prefill and decode pools plus aggregated nodes, each request handed off or served whole.

The Conductor decides as the live one does where a pair and aggregated instances are both live
(``KVCentricPlacement.place_mixed``): the scheduler decides a hand-off over the pools and a whole
serving over the aggregated nodes, and ``PerRequestDisaggregation`` takes the cheaper within the SLOs.
An aggregated node is the coupled baseline's ``chunked`` node (each step decodes the batch and prefills
one chunk of a waiting prompt) with a prefix cache in its HBM, as the live aggregated instance reuses
its own cache; it runs on this simulation's clock, event heap and outcomes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from halfmoon.policy.admission import make_admission
from halfmoon.policy.decode import SloAwareDecode
from halfmoon.policy.disaggregation import PerRequestDisaggregation, Serving
from halfmoon.policy.prefill import make_prefill_policy
from halfmoon.policy.scheduler import KVCentricScheduler
from halfmoon.sim.cache import ClusterCache
from halfmoon.sim.config import SimConfig
from halfmoon.sim.coupled import CoupledSim
from halfmoon.sim.disagg import DisaggregatedSim
from halfmoon.sim.engine import SimBase, SimResult
from halfmoon.sim.profile import Profile
from halfmoon.sim.trace import TraceRequest

AGGREGATED_EVENTS = 16  # event kinds from here on belong to the aggregated nodes (theirs plus this)


class _AggregatedNodes(CoupledSim):
    """Chunked coupled nodes with an HBM prefix cache, sharing ``owner``'s heap and outcomes; ``owner``
    sets ``now`` before calling in."""

    def __init__(self, owner: SimBase, config: SimConfig, profile: Profile, trace: Sequence[TraceRequest]) -> None:
        super().__init__(config, profile, trace)
        self.owner = owner
        self.out = owner.out
        self.cache = ClusterCache([n.id for n in self.nodes], profile.hbm_cache_tokens_per_node // config.block_size,
                                  config.eviction)

    def push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.owner.push(t, AGGREGATED_EVENTS + kind, a, b)


class MixedSim(DisaggregatedSim):
    def __init__(self, config: SimConfig, profile: Profile, trace: Sequence[TraceRequest]) -> None:
        super().__init__(config, profile, trace)
        nodes = dataclasses.replace(config, mode="coupled", prefill_nodes=config.aggregated_nodes, decode_nodes=0,
                                    aggregated_nodes=0, coupled_variant="chunked", cpp_stages=0, admission="none")
        self.aggregated = _AggregatedNodes(self, nodes, profile, trace)
        self.whole_scheduler = KVCentricScheduler(
            make_prefill_policy("local-cache-aware", self.cost, config.slo),
            make_admission(config.admission, SloAwareDecode(self.cost.decode, config.slo)), config.slo)
        self.disaggregation = PerRequestDisaggregation(self.decode_policy, self.cost, config.slo,
                                                       config.handoff_overhead_s, config.chunk_tokens)
        self.whole = np.zeros(len(trace), dtype=bool)

    def _dispatch(self, kind: int, a: int, b: int) -> None:
        if kind >= AGGREGATED_EVENTS:
            self.aggregated.now = self.now
            self.aggregated._dispatch(kind - AGGREGATED_EVENTS, a, b)
        else:
            super()._dispatch(kind, a, b)

    def _arrive(self, rid: int) -> None:
        route = self._route(rid)
        handoff = self._schedule(route)
        nodes = self.aggregated
        nodes.now = self.now
        whole_states = nodes.decode_states()
        whole = self.whole_scheduler.schedule(route, nodes.prefill_states(), whole_states, nodes.index, self.now)
        policy = self.disaggregation
        chosen = policy.choose(policy.handoff(handoff, [self._decode_state(n) for n in self.decode], route),
                               policy.whole(whole, whole_states, route), route.admitted, route.waited_s)
        if chosen.serving is Serving.HANDOFF:
            self._hand_off(rid, route, handoff)
        elif chosen.serving is Serving.WHOLE:
            assert whole.prefill is not None and chosen.whole is not None
            self.whole[rid] = True
            # the node's queue counts the decoding steps the prompt's chunks ride on as well as its prefill
            nodes.enqueue(whole.prefill.instance_id, rid, chosen.whole.ttft_s - whole.prefill.queue_s,
                          whole.step_target_s)
        else:  # the conductor's: the hand-off's own rejection where neither was admitted
            self.turn_away(rid, None if handoff.accepted or whole.accepted else handoff.clears_in_s)

    def _result(self, wall: float) -> SimResult:
        return super()._result(wall)._replace(whole=self.whole)
