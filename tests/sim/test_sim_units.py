import json

import pytest

from halfmoon.policy.cost import DecodeCostModel
from halfmoon.sim.batch import DecodeBatch
from halfmoon.sim.cache import ClusterCache
from halfmoon.sim.config import SimConfig, SimConfigError
from halfmoon.sim.metrics import slowest_decile_mean
from halfmoon.sim.profile import ProfileError, load_profile, profile_from_dict
from halfmoon.sim.trace import TraceFormatError, iter_trace, load_trace

COST = DecodeCostModel((0.010, 0.001, 1e-6))


class TestDecodeBatch:
    def test_epoch_end_matches_step_by_step_sum(self):
        batch = DecodeBatch(COST)
        batch.add(1, 1000, 5, ready_at=0.0)
        batch.add(2, 2000, 8, ready_at=0.0)
        end = batch.begin(0.0)
        steps = [COST.predict(2, 3000 + 2 * j) for j in range(5)]
        assert end == pytest.approx(sum(steps))
        done = batch.close(batch.kmax)
        assert [m.rid for m in done] == [1]
        assert batch.t0 == pytest.approx(sum(steps)) and batch.context == 2000 + 5
        end2 = batch.begin(batch.t0)
        assert end2 == pytest.approx(batch.t0 + sum(COST.predict(1, 2005 + j) for j in range(3)))

    def test_join_waits_for_the_step_in_progress(self):
        batch = DecodeBatch(COST)
        batch.add(1, 0, 100, ready_at=0.0)
        batch.begin(0.0)  # constant-ish 11 ms steps
        k, t = batch.boundary_after(0.025)
        assert k == 3 and t == pytest.approx(batch.elapsed(3))
        assert batch.boundary_after(batch.elapsed(2)) == (2, pytest.approx(batch.elapsed(2)))

    def test_tbt_of_a_member_covers_its_epochs_and_first_gap(self):
        batch = DecodeBatch(DecodeCostModel((0.1, 0.0, 0.0)))
        batch.t0 = 1.0
        batch.add(1, 10, 20, ready_at=0.5)  # waited 0.5 s before its first step
        batch.begin(1.0)
        (member,) = batch.close(batch.kmax)
        values, counts = batch.intervals(member)
        assert sum(counts) == 20
        assert slowest_decile_mean(values, counts, member.gap) == pytest.approx((0.6 + 0.1) / 2)


class TestSlowestDecile:
    def test_mean_of_slowest_tenth(self):
        assert slowest_decile_mean([1.0, 0.1], [1, 19]) == pytest.approx(0.55)
        assert slowest_decile_mean([0.2], [5]) == pytest.approx(0.2)
        assert slowest_decile_mean([], []) == 0.0


class TestNodeCacheAsPrefixIndex:
    def test_a_match_ends_at_the_first_missing_block(self):
        cache = ClusterCache(["a"], capacity_blocks=None).node("a")
        cache.insert(["k0", "k1", "k2"], now=0.0)
        assert cache.match(["k0", "k1", "k2", "k3"]) == 3
        assert cache.match(["k0", "other", "k2"]) == 1
        assert cache.match(["k1"]) == 1 and cache.match([]) == 0

    def test_evict_returns_unlocked_blocks_only(self):
        cache = ClusterCache(["a"], capacity_blocks=None).node("a")
        cache.insert(["k0", "k1"], now=0.0)
        cache.lock(["k0"])
        assert cache.evict(2, now=1.0) == ["k1"]
        cache.unlock(["k0"])
        assert cache.evict(2, now=2.0) == ["k0"] and len(cache) == 0


class TestClusterCache:
    def test_eviction_skips_leased_and_index_follows(self):
        cache = ClusterCache(["a", "b"], capacity_blocks=3, eviction="lru")
        cache.node("a").insert(["x0", "x1", "x2"], now=0.0)
        cache.node("a").lock(["x0", "x1", "x2"])
        cache.node("a").insert(["y0"], now=1.0)  # over capacity but everything older is leased
        assert len(cache.node("a")) == 4
        cache.node("a").unlock(["x0", "x1", "x2"])
        cache.node("a").insert(["z0"], now=2.0)
        assert len(cache.node("a")) <= 3 and "x2" not in cache.node("a") and "x2" not in cache.index
        cache.node("b").insert(["y0"], now=3.0)
        assert cache.index["y0"] == {"a", "b"}

    def test_replica_ranking_puts_the_widely_held_block_first(self):
        cache = ClusterCache(["a", "b", "c"], capacity_blocks=None)
        for node in "abc":
            cache.node(node).insert(["hot"], now=0.0)
        cache.node("a").insert(["cold"], now=5.0)
        ranking = cache.replica_ranking(10.0)
        assert ranking[0][0] == "hot" and ranking[0][1] == pytest.approx(3.0) and ranking[0][2] == 3
        assert ranking[1][1] == pytest.approx(0.5)

    def test_zero_capacity_caches_nothing(self):
        cache = ClusterCache(["a"], capacity_blocks=0)
        cache.node("a").insert(["x"], now=0.0)
        assert cache.index == {}


class TestTraceAndProfile:
    def test_bad_trace_lines_raise_typed_errors(self):
        good = json.dumps({"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": [1]})
        [request] = iter_trace([good, ""])  # the blank line is skipped
        assert request.arrival_s == 0.005
        for bad in ["{", json.dumps({"timestamp": 1}), good.replace("10", "-1"), good.replace("[1]", '"x"')]:
            with pytest.raises(TraceFormatError):
                list(iter_trace([bad]))
        earlier = json.dumps({"timestamp": 1, "input_length": 10, "output_length": 2, "hash_ids": [1]})
        with pytest.raises(TraceFormatError, match="backwards"):
            list(iter_trace([good, earlier]))

    def test_missing_trace_file(self, tmp_path):
        with pytest.raises(FileNotFoundError):
            load_trace(tmp_path / "nope.jsonl")

    def test_bundled_profile_matches_published_figures(self):
        cost = load_profile().cost
        assert 1.0 < cost.prefill.predict(12_000, 0) < 2.0  # ~12k-token prompt on 8xA800
        assert cost.prefill.predict(2_000, 10_000) < cost.prefill.predict(12_000, 0) / 3
        assert 0.015 < cost.decode.predict(1, 12_000) < 0.03
        assert cost.transfer.seconds(131_072) == pytest.approx(0.001 + 131_072 * 327_680 / 87e9)

    def test_profile_from_samples_and_missing_fields(self):
        raw = {
            "name": "tiny", "layers": 2, "kv_bytes_per_token": 100, "decode_capacity_tokens": 1000,
            "dram_cache_tokens_per_node": 1000, "hbm_cache_tokens_per_node": 100,
            "prefill": {"samples": [[x, p, 0.01 + 1e-4 * x] for x in (10, 100, 1000) for p in (0, 50)]},
            "decode": {"samples": [[b, c, 0.005 + 1e-3 * b] for b in (1, 2, 4) for c in (10, 100)]},
            "transfer": {"bandwidth_bytes_per_s": 1e9, "latency_s": 0.0},
        }
        prof = profile_from_dict(raw)
        assert prof.cost.prefill.predict(500, 0) == pytest.approx(0.06)
        del raw["decode"]
        with pytest.raises(ProfileError):
            profile_from_dict(raw)


class TestConfig:
    def test_invalid_settings_raise(self):
        for kwargs in ({"mode": "hybrid"}, {"prefill_policy": "x"}, {"time_scale": 0}, {"eviction": "fifo"}):
            with pytest.raises(SimConfigError):
                SimConfig(**kwargs)


class TestRecentSamples:
    def test_old_samples_expire(self):
        from halfmoon.policy.state import RecentSamples

        recent = RecentSamples(window_s=10.0)
        recent.add(0.0, 1.0)
        recent.add(5.0, 2.0)
        assert recent.values(9.0) == (1.0, 2.0)
        assert recent.values(12.0) == (2.0,)
        assert recent.values(100.0) == ()
