"""The cache-manager's index stays bounded under an endless stream of requests: it grows with the
blocks it holds until the pool's tiers are full, then stays flat, whatever requests leave behind
(puts never ended, leases never released, hand-off blocks never read)."""

from __future__ import annotations

import random
import tracemalloc

from halfmoon.kv.pool_index import PoolIndex
from halfmoon.kv.pool_types import NodeSpec, OrderKind, PoolConfig, Tier
from halfmoon.policy.eviction import Watermarks

BLOCK = 64 << 10
DRAM, NVME = 8 << 20, 32 << 20  # 128 + 512 blocks
BLOCKS_PER_REQUEST = 7


class Workload:
    """What prefill and decode ask of the index per request, with every fourth client vanishing."""

    def __init__(self, index: PoolIndex) -> None:
        self.index, self.rng, self.now = index, random.Random(0), 0.0

    def request(self, i: int) -> None:
        index, self.now = self.index, self.now + 0.05
        keys = [self.rng.randbytes(32) for _ in range(BLOCKS_PER_REQUEST)]
        index.lookup(keys, self.now)  # prefill's prefix fetch (a miss: fresh prompt)
        scratch = self.rng.randbytes(32)  # the partial last block, under a one-off key
        placed = index.put_start([*keys, scratch], [BLOCK] * (BLOCKS_PER_REQUEST + 1), self.now)
        if i % 4 == 3:
            return  # the writer vanished: the put is never ended
        index.put_end([p.key for p in placed if p.replicas], self.now)
        lease = index.lookup(keys, self.now).lease  # decode's read
        if lease is not None and i % 8 != 1:  # and sometimes the release is lost too
            index.release(lease.lease_id)
        if i % 8 != 5:
            index.remove([scratch])  # decode drops the hand-off block once read

    def housekeeping(self) -> None:
        for order in self.index.expire(self.now) + self.index.plan(self.now):
            if order.kind is not OrderKind.FREE:
                self.index.order_done(order.order_id, True, self.now)


def run(index: PoolIndex, workload: Workload, start: int, end: int) -> None:
    for i in range(start, end):
        workload.request(i)
        if i % 5 == 0:  # the manager's housekeeping interval, in requests
            workload.housekeeping()


class TestIndexStaysBounded:
    def test_memory_flat_once_the_pool_is_full(self) -> None:
        config = PoolConfig(replicas=1, watermarks=Watermarks(high=0.9, low=0.7), put_timeout_s=5.0,
                            lease_ttl_s=2.0)
        index = PoolIndex(config)
        index.add_node(NodeSpec("node-0", "127.0.0.1:1", "seg", {Tier.DRAM: DRAM, Tier.NVME: NVME}))
        workload = Workload(index)
        tracemalloc.start()
        try:
            run(index, workload, 0, 600)  # 4,800 blocks: fills both tiers several times over
            filled = tracemalloc.get_traced_memory()[0]
            run(index, workload, 600, 2400)
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        stats = index.stats()
        assert stats.blocks + stats.pending_puts <= (DRAM + NVME) // BLOCK
        assert after < filled * 1.1 + (64 << 10), (filled, after)  # 3x the requests, no growth

    def test_abandoned_puts_and_leases_all_expire(self) -> None:
        index = PoolIndex(PoolConfig(replicas=1, put_timeout_s=5.0, lease_ttl_s=2.0))
        index.add_node(NodeSpec("node-0", "127.0.0.1:1", "seg", {Tier.DRAM: DRAM, Tier.NVME: NVME}))
        workload = Workload(index)
        run(index, workload, 0, 200)
        assert index.stats().pending_puts and index.stats().leases
        workload.now += 10.0  # past both deadlines
        workload.housekeeping()
        stats = index.stats()
        assert (stats.pending_puts, stats.leases, stats.orders_in_flight) == (0, 0, 0)
