from collections import Counter

import pytest

from halfmoon.policy.prefill import (
    GlobalCacheAwarePrefill,
    LeastLoadedPrefill,
    LocalCacheAwarePrefill,
    NoPrefillInstanceError,
    RandomPrefill,
    make_prefill_policy,
)
from halfmoon.policy.state import SLO, PrefillInstanceState, RouteRequest, pool_prefix_length, prefix_lengths

KEYS = tuple(f"k{i}" for i in range(10))
REQUEST = RouteRequest(block_keys=KEYS, prompt_tokens=1000, block_size=100)


def holder_index(holder: str, blocks: int = 10) -> dict[str, set[str]]:
    return {k: {holder} for k in KEYS[:blocks]}


class TestPrefixLengths:
    def test_walks_chain_and_stops_at_first_gap(self):
        index = {"k0": {"a", "b"}, "k1": {"a"}, "k2": {"a", "b"}, "k3": {"b"}}
        assert prefix_lengths(KEYS, index, ["a", "b", "c"]) == {"c": 0, "b": 1, "a": 3}
        assert pool_prefix_length(KEYS, index) == 4


class TestLocalCacheAware:
    def test_prefix_holder_wins_when_queues_equal(self, cost):
        states = [PrefillInstanceState("a", 0.5), PrefillInstanceState("b", 0.5)]
        choice = LocalCacheAwarePrefill(cost).choose(REQUEST, states, holder_index("b"))
        assert choice.instance_id == "b"
        assert choice.prefix_blocks == 10
        assert choice.prefill_s == pytest.approx(1e-3)  # one token is always computed
        assert choice.ttft_s == pytest.approx(0.501)

    def test_queue_outweighing_recompute_sends_request_elsewhere(self, cost):
        # recomputing 1000 tokens costs 1 s; the holder's 5 s queue is worse.
        states = [PrefillInstanceState("a", 0.0), PrefillInstanceState("b", 5.0)]
        choice = LocalCacheAwarePrefill(cost).choose(REQUEST, states, holder_index("b"))
        assert choice.instance_id == "a"
        assert choice.prefix_blocks == 0
        assert choice.ttft_s == pytest.approx(1.0)


class TestGlobalCacheAware:
    def test_busy_holder_is_pulled_from_instead_of_recomputing(self, cost):
        states = [PrefillInstanceState("a", 0.0), PrefillInstanceState("b", 5.0)]
        choice = GlobalCacheAwarePrefill(cost).choose(REQUEST, states, holder_index("b"))
        assert choice.instance_id == "a"
        assert choice.prefix_blocks == 10
        assert choice.pulls == tuple((k, "b") for k in KEYS)
        assert choice.transfer_s == pytest.approx(999e-6)
        assert choice.ttft_s == pytest.approx(999e-6 + 1e-3)

    def test_recomputes_when_transfer_is_slower_than_compute(self, slow_transfer_cost):
        states = [PrefillInstanceState("a", 0.0), PrefillInstanceState("b", 5.0)]
        choice = GlobalCacheAwarePrefill(slow_transfer_cost).choose(REQUEST, states, holder_index("b"))
        assert (choice.instance_id, choice.prefix_blocks, choice.pulls) == ("a", 0, ())

    def test_holder_still_wins_when_its_queue_is_short(self, cost):
        states = [PrefillInstanceState("a", 0.0), PrefillInstanceState("b", 0.0005)]
        choice = GlobalCacheAwarePrefill(cost).choose(REQUEST, states, holder_index("b"))
        assert choice.instance_id == "b" and choice.pulls == ()

    def test_balancing_threshold_keeps_a_close_local_match(self, cost):
        index = holder_index("b")
        for k in KEYS[:8]:
            index[k].add("a")
        states = [PrefillInstanceState("a", 0.0), PrefillInstanceState("b", 5.0)]
        strict = GlobalCacheAwarePrefill(cost, balancing_threshold=1.5).choose(REQUEST, states, index)
        assert (strict.instance_id, strict.prefix_blocks, strict.pulls) == ("a", 8, ())
        eager = GlobalCacheAwarePrefill(cost, balancing_threshold=1.0).choose(REQUEST, states, index)
        assert eager.pulls == (("k8", "b"), ("k9", "b"))

    def test_pulls_assemble_a_prefix_spread_over_holders(self, cost):
        index = {k: {"b"} for k in KEYS[:5]} | {k: {"c"} for k in KEYS[5:]}
        states = [PrefillInstanceState("a", 0.0), PrefillInstanceState("b", 5.0), PrefillInstanceState("c", 5.0)]
        choice = GlobalCacheAwarePrefill(cost).choose(REQUEST, states, index)
        assert choice.instance_id == "a"
        assert [src for _, src in choice.pulls] == ["b"] * 5 + ["c"] * 5

    def test_rejects_threshold_below_one(self, cost):
        with pytest.raises(ValueError):
            GlobalCacheAwarePrefill(cost, balancing_threshold=0.5)


class TestBaselines:
    def test_load_balancing_ignores_cache_and_prefers_slo_attainment(self, cost):
        states = [
            PrefillInstanceState("a", 0.1, recent_ttft=(50.0, 1.0)),
            PrefillInstanceState("b", 3.0, recent_ttft=(1.0,)),
            PrefillInstanceState("c", 2.0),
        ]
        choice = LeastLoadedPrefill(cost, SLO(ttft_s=30.0)).choose(REQUEST, states, holder_index("b"))
        assert choice.instance_id == "c"
        assert choice.prefix_blocks == 0

    def test_random_is_seeded_and_spreads(self, cost):
        states = [PrefillInstanceState(s, 0.0) for s in "abcd"]
        picks = [RandomPrefill(cost, seed=7).choose(REQUEST, states, {}).instance_id for _ in range(3)]
        assert len(set(picks)) == 1
        policy = RandomPrefill(cost, seed=7)
        counts = Counter(policy.choose(REQUEST, states, {}).instance_id for _ in range(400))
        assert set(counts) == set("abcd") and min(counts.values()) > 50

    def test_empty_pool_raises_typed_error(self, cost):
        with pytest.raises(NoPrefillInstanceError):
            make_prefill_policy("global-cache-aware", cost).choose(REQUEST, [], {})

    def test_factory_rejects_unknown_name(self, cost):
        with pytest.raises(ValueError, match="unknown prefill policy"):
            make_prefill_policy("fastest", cost)
