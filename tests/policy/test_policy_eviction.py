import pytest

from halfmoon.policy.eviction import (
    EvictionPolicy,
    LengthAwareEviction,
    LFUEviction,
    LRUEviction,
    Watermarks,
    make_eviction,
)


def filled(policy: EvictionPolicy, keys_positions: list[tuple[str, int]]) -> EvictionPolicy:
    for t, (key, pos) in enumerate(keys_positions):
        policy.on_insert(key, now=float(t), chain_position=pos)
    return policy


class TestLRU:
    def test_least_recent_first_and_hits_refresh(self):
        lru = filled(LRUEviction(), [("a", 0), ("b", 0), ("c", 0)])
        lru.on_access("a", now=10.0)
        assert lru.victims(3) == ["b", "c", "a"]
        lru.on_insert("b", now=11.0)  # re-insert counts as a use
        assert lru.victims(2) == ["c", "a"]


class TestLFU:
    def test_fewest_hits_first_ties_by_recency(self):
        lfu = filled(LFUEviction(), [("a", 0), ("b", 0), ("c", 0), ("d", 0)])
        for _ in range(3):
            lfu.on_access("a", now=5.0)
        lfu.on_access("c", now=6.0)
        lfu.on_access("b", now=7.0)
        assert lfu.victims(4) == ["d", "c", "b", "a"]


class TestLengthAware:
    def test_deepest_chain_position_first(self):
        la = filled(LengthAwareEviction(), [("root", 0), ("mid", 1), ("leaf", 2), ("leaf2", 2), ("other", 0)])
        la.on_access("leaf", now=9.0)
        assert la.victims(5) == ["leaf2", "leaf", "mid", "root", "other"]

    def test_negative_position_is_rejected(self):
        with pytest.raises(ValueError):
            LengthAwareEviction().on_insert("x", now=0.0, chain_position=-1)


@pytest.mark.parametrize("name", ["lru", "lfu", "length-aware"])
class TestContract:
    def test_protected_keys_are_skipped_but_kept(self, name):
        policy = filled(make_eviction(name), [("a", 0), ("b", 1), ("c", 2)])
        victims = policy.victims(3, protected=lambda k: k == "b")
        assert "b" not in victims and len(victims) == 2
        assert len(policy) == 3 and all(k in policy for k in "abc")

    def test_victims_never_remove_and_remove_forgets(self, name):
        policy = filled(make_eviction(name), [("a", 0), ("b", 1)])
        first = policy.victims(1)
        assert policy.victims(1) == first
        policy.on_remove(first[0])
        policy.on_remove("never-seen")
        assert first[0] not in policy and len(policy) == 1
        assert policy.victims(5) == [k for k in "ab" if k != first[0]]
        policy.on_access("never-seen", now=1.0)
        assert set(policy.keys()) == {k for k in "ab" if k != first[0]}
        assert policy.victims(0) == []


class TestFactoryAndWatermarks:
    def test_unknown_policy(self):
        with pytest.raises(ValueError, match="unknown eviction policy"):
            make_eviction("fifo")

    def test_watermarks(self):
        marks = Watermarks(high=0.9, low=0.5)
        assert marks.excess(90, 100) == 0
        assert marks.excess(91, 100) == 41
        with pytest.raises(ValueError):
            Watermarks(high=0.5, low=0.9)
