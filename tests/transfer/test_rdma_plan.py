"""The device-free half of RDMA: work-request batching, memory registrations, completion bookkeeping;
and the verbs layer itself, which needs an RDMA device (skipped, with the reason, without one)."""

from __future__ import annotations

import os
import random

import pytest

from halfmoon.transfer.rdma import (
    RdmaUnavailable,
    VerbsDevice,
    VerbsPath,
    VerbsSegment,
    rdma_devices,
)
from halfmoon.transfer.rdma_plan import (
    CompletionError,
    Completions,
    Copy,
    Post,
    PostLimits,
    Region,
    Registrations,
    Sge,
    WorkRequest,
    plan_posts,
    plan_work_requests,
)


def execute(posts: list[Post], local: bytearray, remote: bytearray, write: bool) -> None:
    """What a NIC does with the plan, with addresses as indices into two byte arrays."""
    for post in posts:
        for wr in post.wrs:
            pos = wr.remote
            for sge in wr.sges:
                if write:
                    remote[pos : pos + sge.length] = local[sge.addr : sge.addr + sge.length]
                else:
                    local[sge.addr : sge.addr + sge.length] = remote[pos : pos + sge.length]
                pos += sge.length


class TestWorkRequestBatching:
    def test_remote_adjacent_copies_share_a_request_up_to_max_sge(self) -> None:
        # four 100-byte blocks adjacent in the segment, scattered in local memory
        copies = [Copy(1000 * i, 5000 + 100 * i, 100) for i in range(4)]
        wrs = plan_work_requests(copies, PostLimits(max_sge=3))
        assert wrs == [
            WorkRequest(5000, (Sge(0, 100), Sge(1000, 100), Sge(2000, 100))),
            WorkRequest(5300, (Sge(3000, 100),)),
        ]

    def test_copies_contiguous_on_both_sides_become_one_element(self) -> None:
        wrs = plan_work_requests([Copy(0, 64, 10), Copy(10, 74, 6), Copy(100, 80, 4)])
        assert wrs == [WorkRequest(64, (Sge(0, 16), Sge(100, 4)))]

    def test_messages_are_split_at_max_message(self) -> None:
        wrs = plan_work_requests([Copy(0, 0, 10)], PostLimits(max_message=4))
        assert [(w.remote, w.sges) for w in wrs] == [(0, (Sge(0, 4),)), (4, (Sge(4, 4),)), (8, (Sge(8, 2),))]

    def test_posts_hold_at_most_max_wr_requests_in_order(self) -> None:
        copies = [Copy(i * 10, i * 20, 10) for i in range(10)]  # never adjacent remotely
        posts = plan_posts(copies, PostLimits(max_wr=4, queue_depth=4))
        assert [len(p.wrs) for p in posts] == [4, 4, 2]
        assert [wr.remote for p in posts for wr in p.wrs] == [c.remote for c in copies]

    @pytest.mark.parametrize("write", [True, False])
    def test_executing_the_plan_moves_exactly_the_copies_bytes(self, write: bool) -> None:
        rng = random.Random(7)
        size = 1 << 16
        local, remote = bytearray(os.urandom(size)), bytearray(os.urandom(size))
        expect_local, expect_remote = bytearray(local), bytearray(remote)
        # disjoint blocks of random sizes, some remote neighbours, shuffled local placement
        lengths = [rng.randrange(1, 700) for _ in range(60)]
        remote_at, pos = [], 0
        for n in lengths:
            pos += rng.choice((0, 0, rng.randrange(1, 50)))
            remote_at.append(pos)
            pos += n
        local_slots = list(range(60))
        rng.shuffle(local_slots)
        copies = [Copy(slot * 1000, r, n) for slot, r, n in zip(local_slots, remote_at, lengths)]
        for c in copies:
            if write:
                expect_remote[c.remote : c.remote + c.length] = local[c.local : c.local + c.length]
            else:
                expect_local[c.local : c.local + c.length] = remote[c.remote : c.remote + c.length]
        limits = PostLimits(max_sge=4, max_wr=8, max_message=900, queue_depth=16)
        posts = plan_posts(copies, limits)
        assert all(len(wr.sges) <= 4 and wr.length <= 900 for p in posts for wr in p.wrs)
        assert sum(p.nbytes for p in posts) == sum(lengths)
        execute(posts, local, remote, write)
        assert (local, remote) == (expect_local, expect_remote)

    def test_bad_input_is_refused(self) -> None:
        with pytest.raises(ValueError):
            plan_work_requests([Copy(0, 0, 0)])
        with pytest.raises(ValueError):
            plan_posts([Copy(0, 0, 1)], PostLimits(max_wr=8, queue_depth=4))


class TestRegistrations:
    def test_missing_merges_spans_into_page_aligned_regions(self) -> None:
        regs: Registrations[str] = Registrations()
        assert regs.missing([(100, 50), (4000, 200), (20_000, 1)]) == [Region(0, 8192), Region(16384, 4096)]

    def test_covered_spans_need_nothing_and_find_their_handle(self) -> None:
        regs: Registrations[str] = Registrations()
        regs.add(Region(0, 8192), "mr0")
        assert regs.missing([(10, 8000)]) == []
        assert regs.handle(4096, 4096) == "mr0"
        with pytest.raises(KeyError):
            regs.handle(8000, 500)

    def test_a_span_straddling_a_registration_gets_a_region_of_its_own(self) -> None:
        regs: Registrations[str] = Registrations()
        regs.add(Region(0, 4096), "mr0")
        (region,) = regs.missing([(4000, 200)])
        assert region == Region(0, 8192)  # overlapping the old one is allowed; one region must cover the span
        regs.add(region, "mr1")
        assert regs.handle(4000, 200) == "mr1" and regs.handle(0, 100) == "mr0"
        assert regs.remove(Region(0, 4096)) == "mr0" and len(regs) == 1


class TestCompletions:
    def post(self, n: int, length: int = 10) -> Post:
        return Post(tuple(WorkRequest(i * length, (Sge(0, length),)) for i in range(n)))

    def test_queue_room_is_reserved_per_post_and_freed_by_its_signalled_completion(self) -> None:
        done = Completions(queue_depth=5)
        first = done.reserve(self.post(3))
        assert first == [1, 2, 3]
        assert done.reserve(self.post(3)) is None  # 3 + 3 > 5: poll first
        done.complete(3, ok=True)
        assert done.done and done.bytes_done == 30
        assert done.reserve(self.post(3)) == [4, 5, 6] and done.in_flight == 1

    def test_an_error_fails_the_transfer_once_even_with_flushed_requests(self) -> None:
        done = Completions(queue_depth=8)
        ids = done.reserve(self.post(4))
        assert ids is not None
        done.complete(ids[1], ok=False, status="remote access error")  # unsignalled requests report errors too
        done.complete(ids[-1], ok=False, status="flushed")  # the queue pair then flushes the rest
        assert done.done and done.errors == [f"wr {ids[1]}: remote access error"]
        with pytest.raises(CompletionError, match="remote access error"):
            done.raise_if_failed()

    def test_a_post_larger_than_the_queue_is_refused(self) -> None:
        with pytest.raises(ValueError):
            Completions(queue_depth=2).reserve(self.post(3))


def device_or_skip() -> VerbsDevice:
    try:
        rdma_devices()
    except RdmaUnavailable as exc:
        pytest.skip(f"needs an RDMA device: {exc}")
    return VerbsDevice()


class TestVerbsLoopback:
    def test_one_sided_write_and_read_through_a_loopback_queue_pair(self) -> None:
        device = device_or_skip()
        segment = bytearray(1 << 20)
        node = VerbsSegment(device, memoryview(segment))
        qp, cq, local = device.queue_pair()
        peer = node.accept(local)
        device.connect(qp, local, peer)
        path = VerbsPath(device, qp, cq, peer)
        data = bytearray(os.urandom(256 << 10))
        out = bytearray(len(data))
        path.memory.pin(data)
        path.memory.pin(out)
        try:
            from halfmoon.transfer.local_memory import address_of

            path.transfer(True, [Copy(address_of(data), 4096, len(data))])
            assert segment[4096 : 4096 + len(data)] == data
            path.transfer(False, [Copy(address_of(out), 4096, len(out))])
            assert out == data
        finally:
            path.close()
            node.close()
            device.close()
