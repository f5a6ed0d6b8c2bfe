"""ExtentAllocator: first fit, coalescing of freed neighbours, claims, out-of-space."""

from __future__ import annotations

import contextlib
import random

import pytest

from halfmoon.storage.allocator import Extent, ExtentAllocator, OutOfSpace


class TestFirstFit:
    def test_allocates_lowest_fitting_offset_with_alignment(self) -> None:
        a = ExtentAllocator(4096, alignment=64)
        assert a.allocate(100) == Extent(0, 100)
        assert a.allocate(1) == Extent(128, 1)
        assert a.used == 192

    def test_reuses_freed_hole_of_same_size(self) -> None:
        a = ExtentAllocator(1024, alignment=64)
        blocks = [a.allocate(128) for _ in range(8)]
        a.free(blocks[3].offset)
        assert a.allocate(128).offset == blocks[3].offset


class TestCoalescing:
    def test_neighbours_merge_into_one_extent(self) -> None:
        a = ExtentAllocator(1024, alignment=64)
        offs = [a.allocate(128).offset for _ in range(8)]
        a.free(offs[1])
        a.free(offs[3])
        assert a.fragments == 2 and a.largest_free == 128
        with pytest.raises(OutOfSpace):
            a.allocate(384)  # 256 bytes free in total, but in two holes
        a.free(offs[2])  # joins both holes
        assert a.fragments == 1 and a.largest_free == 384
        assert a.allocate(384).offset == offs[1]

    def test_random_churn_returns_to_one_extent(self) -> None:
        rng = random.Random(4)
        a = ExtentAllocator(1 << 20, alignment=64)
        live: list[int] = []
        for _ in range(2000):
            if live and rng.random() < 0.5:
                a.free(live.pop(rng.randrange(len(live))))
            else:
                with contextlib.suppress(OutOfSpace):
                    live.append(a.allocate(rng.randint(1, 20_000)).offset)
        for off in live:
            a.free(off)
        assert a.used == 0 and a.fragments == 1 and a.largest_free == a.capacity


class TestClaimAndErrors:
    def test_claim_exact_range_then_overlap_fails(self) -> None:
        a = ExtentAllocator(1024, alignment=64)
        assert a.claim(256, 100) == Extent(256, 100)
        with pytest.raises(OutOfSpace):
            a.claim(320, 64)
        assert a.allocate(256) == Extent(0, 256)
        assert a.allocate(64).offset == 384

    def test_out_of_space_and_bad_input(self) -> None:
        a = ExtentAllocator(256, alignment=64)
        a.allocate(256)
        with pytest.raises(OutOfSpace):
            a.allocate(1)
        with pytest.raises(ValueError):
            a.allocate(0)
        with pytest.raises(ValueError):
            a.claim(3, 10)
        with pytest.raises(KeyError):
            a.free(64)
        with pytest.raises(ValueError):
            ExtentAllocator(1024, alignment=48)


class TestBatches:
    def test_a_run_is_placed_back_to_back_and_each_block_freed_alone(self) -> None:
        a = ExtentAllocator(4096, alignment=64)
        a.allocate(64)
        run = a.allocate_run([100, 64, 1])
        assert run == [Extent(64, 100), Extent(192, 64), Extent(256, 1)]
        assert a.used == 64 + 128 + 64 + 64 and a.fragments == 1
        a.free(run[1].offset)
        assert a.allocate(64).offset == 192  # the hole of one block of the run
        a.free_many([run[0].offset, 192, run[2].offset])
        a.free(0)
        assert a.used == 0 and a.fragments == 1 and a.largest_free == a.capacity

    def test_without_room_for_the_whole_run_blocks_go_where_each_fits(self) -> None:
        a = ExtentAllocator(1024, alignment=64)
        offs = [a.allocate(128).offset for _ in range(8)]
        a.free(offs[1])
        a.free(offs[5])
        assert [e.offset for e in a.allocate_run([128, 128])] == [offs[1], offs[5]]
        with pytest.raises(OutOfSpace):
            a.allocate_run([64, 64])  # full: all or nothing
        assert a.used == 1024

    def test_a_run_that_cannot_be_placed_takes_nothing(self) -> None:
        a = ExtentAllocator(1024, alignment=64)
        a.allocate(512)
        with pytest.raises(OutOfSpace):
            a.allocate_run([256, 256, 64])
        assert a.used == 512 and a.fragments == 1

    def test_free_many_refuses_unknown_or_repeated_offsets_and_frees_none(self) -> None:
        a = ExtentAllocator(1024, alignment=64)
        run = a.allocate_run([64, 64])
        for bad in ([run[0].offset, 999], [run[0].offset, run[0].offset]):
            with pytest.raises(KeyError):
                a.free_many(bad)
            assert a.used == 128
        a.free_many([e.offset for e in run])
        assert a.used == 0 and a.fragments == 1
