"""The block pool: one state object per block, consecutive allocation, typed cache events."""

from __future__ import annotations

from pathlib import Path

from halfmoon.engine.block_pool import BlockPool, BlockRemoved, BlockStored
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine, random_prompts


class TestConsecutiveAllocation:
    def test_growing_sequences_keep_their_blocks_in_few_runs(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama, kv_cache_blocks=128, max_num_batched_tokens=512, prefill_chunk_size=64)
        prompts = random_prompts(engine.vocab_size, [20, 35, 17, 45, 9, 32, 25, 13], seed=1)
        params = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        most_runs = 0
        while engine.has_unfinished():
            engine.step()
            most_runs = max([most_runs] + [len(s.block_runs) for s in engine.scheduler.running])
            for seq in engine.scheduler.running:
                flat = [b for first, count in seq.block_runs for b in range(first, first + count)]
                assert flat == seq.block_table
        assert most_runs <= 2  # interleaved growth of 8 sequences, yet each reads at most two slices

    def test_allocation_extends_a_run_and_falls_back_to_eviction(self) -> None:
        pool = BlockPool(4)
        first = pool.allocate(2)
        assert pool.allocate(1, after=first[-1]) == [first[-1] + 1]
        pool.register(b"k0", first[0])
        pool.release(first[0])
        assert pool.blocks[first[0]].key == b"k0" and pool.num_free == 2
        rest = pool.allocate(2)
        assert first[0] in rest and b"k0" not in pool.cached
        assert all(pool.blocks[b].ref_count == 1 for b in rest)


class TestCacheEvents:
    def test_events_come_in_order_and_only_once(self) -> None:
        pool = BlockPool(2)
        (a,) = pool.allocate(1)
        pool.register(b"a", a)
        pool.register(b"again", a)  # first writer wins: no second key for the same block
        pool.release(a)
        pool.allocate(2)
        assert pool.take_events() == [BlockStored([b"a"]), BlockRemoved([b"a"])]
        assert pool.take_events() == []


class TestPrefixIndex:
    def test_locked_keys_survive_eviction_and_match_stops_at_a_miss(self) -> None:
        pool = BlockPool(3)
        blocks = pool.allocate(3)
        for key, block in zip((b"a", b"b", b"c"), blocks):
            pool.register(key, block)
            pool.release(block)
        assert pool.match([b"a", b"b", b"x", b"c"]) == 2
        pool.lock([b"a"])
        pool.touch([b"b"])  # b is now the most recently used evictable key
        assert pool.evict(5) == [b"c", b"b"]
        assert pool.match([b"a", b"b"]) == 1 and pool.num_free == 2
        pool.unlock([b"a"])
        assert pool.evict(1) == [b"a"] and pool.num_free == 3
