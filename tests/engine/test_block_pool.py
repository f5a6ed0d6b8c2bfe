"""The block pool: one state object per block, consecutive allocation, typed cache events."""

from __future__ import annotations

from halfmoon.engine.block_manager import BlockManager
from halfmoon.engine.block_pool import BlockPool, BlockRemoved, BlockStored
from halfmoon.engine.sequence import Sequence
from halfmoon.protocol.sampling import SamplingParams


class TestConsecutiveAllocation:
    def test_growing_sequences_keep_their_blocks_in_few_runs(self) -> None:
        manager = BlockManager(num_blocks=128, block_size=16)
        params = SamplingParams(max_tokens=64, temperature=0.0)
        seqs = [Sequence(f"r{i}", [1] * n, params, i) for i, n in enumerate([20, 35, 17, 45, 9, 32, 25, 13])]
        for seq in seqs:
            manager.allocate_slots(seq, seq.num_tokens)
        for _ in range(64):  # interleaved decode: every sequence grows by one token per step
            for seq in seqs:
                seq.token_ids.append(1)
                manager.allocate_slots(seq, seq.num_tokens)
        for seq in seqs:
            assert [b for first, count in seq.block_runs for b in range(first, first + count)] == seq.block_table
        assert max(len(seq.block_runs) for seq in seqs) == 1

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
