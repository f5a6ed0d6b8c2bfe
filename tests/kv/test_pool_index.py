"""PoolIndex: the put protocol, leases, tiering orders, node loss and rebuild (pure, no I/O)."""

from __future__ import annotations

import pytest

from halfmoon.core.keys import BlockHasher
from halfmoon.kv.pool_index import PoolIndex
from halfmoon.kv.pool_types import InventoryItem, NodeSpec, OrderKind, PoolConfig, Tier, UnknownPut
from halfmoon.policy.eviction import Watermarks

MB = 1 << 20
KEYS = BlockHasher(4, "test-model").keys(list(range(4 * 64)))


def node(name: str, dram: int = 10, nvme: int = 0, s3: int = 0) -> NodeSpec:
    caps = {Tier.DRAM: dram * MB, Tier.NVME: nvme * MB, Tier.S3: s3 * MB}
    return NodeSpec(name, f"127.0.0.1:{1000 + len(name)}", f"seg-{name}", {t: c for t, c in caps.items() if c})


def index(*nodes: NodeSpec, **cfg) -> PoolIndex:  # type: ignore[no-untyped-def]
    cfg.setdefault("watermarks", Watermarks(high=0.8, low=0.5))
    idx = PoolIndex(PoolConfig(**cfg))
    for spec in nodes:
        idx.add_node(spec)
    return idx


def store(idx: PoolIndex, keys: list[bytes], now: float = 0.0, size: int = MB) -> None:
    idx.put_start(keys, [size] * len(keys), now)
    idx.put_end(keys, now)


def finish(idx: PoolIndex, orders, now: float = 0.0, ok: bool = True) -> None:  # type: ignore[no-untyped-def]
    for order in orders:
        if order.dst is not None:
            idx.order_done(order.order_id, ok, now)


class TestPutProtocol:
    def test_visible_only_after_put_end(self) -> None:
        idx = index(node("a"))
        placements = idx.put_start(KEYS[:2], [MB, MB], now=0)
        assert [p.replicas[0].tier for p in placements] == [Tier.DRAM, Tier.DRAM]
        assert placements[0].replicas[0].offset != placements[1].replicas[0].offset
        assert idx.lookup(KEYS[:2], now=1).hits == []
        idx.put_end(KEYS[:2], now=1)
        assert len(idx.lookup(KEYS[:2], now=2).hits) == 2
        assert idx.put_start(KEYS[:1], [MB], now=3)[0].exists

    def test_put_never_ended_is_revoked_and_reclaimed(self) -> None:
        idx = index(node("a"), put_timeout_s=5.0)
        placement = idx.put_start(KEYS[:1], [MB], now=0)[0]
        assert idx.expire(now=4.9) == []
        freed = idx.expire(now=5.0)
        assert [(o.kind, o.src) for o in freed] == [(OrderKind.FREE, placement.replicas[0])]
        assert idx.stats().tiers[0].used == 0 and idx.stats().pending_puts == 0
        with pytest.raises(UnknownPut):
            idx.put_end(KEYS[:1], now=6)
        assert idx.lookup(KEYS[:1], now=6).hits == []

    def test_put_end_commits_known_keys_before_reporting_unknown(self) -> None:
        idx = index(node("a"))
        idx.put_start(KEYS[:1], [MB], now=0)
        with pytest.raises(UnknownPut):
            idx.put_end([KEYS[0], KEYS[5]], now=0)
        assert len(idx.lookup(KEYS[:1], now=1).hits) == 1

    def test_replicas_on_distinct_nodes(self) -> None:
        idx = index(node("a"), node("b"), node("c"), replicas=2)
        (placement,) = idx.put_start(KEYS[:1], [MB], now=0)
        assert len({r.node for r in placement.replicas}) == 2

    def test_full_pool_places_nothing_and_bad_input_changes_nothing(self) -> None:
        idx = index(node("a", dram=1))
        with pytest.raises(ValueError):
            idx.put_start([KEYS[0], b"short"], [MB, MB], now=0)
        with pytest.raises(ValueError):
            idx.put_start(KEYS[:2], [MB], now=0)
        assert idx.stats().pending_puts == 0
        first, second = idx.put_start(KEYS[:2], [MB, MB], now=0)
        assert first.replicas and second.replicas == () and not second.exists


class TestMatch:
    def test_counts_visible_leading_blocks_without_leasing(self) -> None:
        idx = index(node("n"))
        store(idx, KEYS[:2])
        idx.put_start(KEYS[2:3], [MB], now=0)  # written, not yet visible
        assert idx.match(KEYS[:4]) == 2
        assert idx.match([KEYS[1]]) == 1 and idx.match([KEYS[3], KEYS[0]]) == 0
        assert idx.stats().leases == 0 and idx.stats().lookups == 0


class TestLookupAndLeases:
    def test_longest_visible_prefix(self) -> None:
        idx = index(node("a"))
        store(idx, [KEYS[0], KEYS[1], KEYS[3]])
        result = idx.lookup(KEYS[:4], now=1)
        assert len(result.hits) == 2 and result.lease is not None
        assert idx.stats().miss_blocks == 2

    def test_leased_block_survives_pressure(self) -> None:
        idx = index(node("a"))  # 10 blocks fit; high mark at 8
        store(idx, KEYS[:9], now=0)  # KEYS[0] is the least recently used
        lease = idx.lookup(KEYS[:1], now=0).lease  # now leased, and LRU would still be next-oldest
        dropped = {o.key for o in idx.plan(now=1)}
        assert KEYS[0] not in dropped and len(dropped) == 4  # 9 MB -> 5 MB
        assert idx.release(lease.lease_id) and not idx.release(lease.lease_id)

    def test_lease_expires(self) -> None:
        idx = index(node("a"), lease_ttl_s=2.0)
        store(idx, KEYS[:9])
        idx.lookup(KEYS[:9], now=0)
        assert idx.plan(now=1) == []  # everything leased
        idx.expire(now=2.0)
        assert idx.stats().leases == 0
        assert len(idx.plan(now=2.0)) == 4


class TestEvictionOrder:
    @pytest.mark.parametrize(
        ("policy", "expected"),
        [("lru", [1, 7, 8, 0]), ("lfu", [1, 7, 8, 2]), ("length-aware", [8, 7, 6, 5])],
    )
    def test_victims_follow_the_configured_policy(self, policy: str, expected: list[int]) -> None:
        idx = index(node("a"), eviction=policy)
        for i in range(9):  # one chain, stored block by block
            idx.put_start([KEYS[i]], [MB], now=i, first_position=i)
            idx.put_end([KEYS[i]], now=i)
        # block 0: three early hits (frequent); blocks 2..6: one later hit each (recent)
        for now, i in enumerate([0, 0, 0, 2, 3, 4, 5, 6], start=10):
            idx.release(idx.lookup([KEYS[i]], now=now).lease.lease_id)
        orders = idx.plan(now=20)
        assert [KEYS.index(o.key) for o in orders] == expected
        assert {o.kind for o in orders} == {OrderKind.FREE}  # no lower tier: dropped


class TestDemotion:
    def test_dram_pressure_demotes_to_nvme_then_s3(self) -> None:
        idx = index(node("a", dram=10, nvme=3, s3=100))
        store(idx, KEYS[:9])
        orders = idx.plan(now=1)
        assert [o.kind for o in orders] == [OrderKind.DEMOTE] * 4
        assert [o.dst.tier for o in orders] == [Tier.NVME, Tier.NVME, Tier.NVME, Tier.S3]  # NVMe full
        assert idx.plan(now=1) == []  # demotions in flight already cover the excess
        finish(idx, orders)
        hits = idx.lookup(KEYS[:9], now=2).hits
        assert [h[0].tier for h in hits[:4]] == [Tier.NVME, Tier.NVME, Tier.NVME, Tier.S3]
        assert all(len(h) == 1 for h in hits)
        assert idx.stats().tiers[0].used == 5 * MB
        idx.expire(now=100)  # the lookups' leases run out
        cascade = idx.plan(now=100)  # NVMe is now above its own high watermark
        assert [(o.kind, o.src.tier, o.dst.tier) for o in cascade] == [(OrderKind.DEMOTE, Tier.NVME, Tier.S3)] * 2

    def test_failed_demotion_keeps_the_source(self) -> None:
        idx = index(node("a", dram=10, nvme=100))
        store(idx, KEYS[:9])
        orders = idx.plan(now=1)
        finish(idx, orders, ok=False)
        hits = idx.lookup(KEYS[:9], now=2).hits
        assert all(h == (h[0],) and h[0].tier is Tier.DRAM for h in hits)
        assert [s.used for s in idx.stats().tiers] == [9 * MB, 0]

    def test_unavailable_s3_is_skipped_and_reported(self) -> None:
        idx = index(node("a", dram=10, s3=100))
        idx.set_tier_available("a", Tier.S3, False)
        store(idx, KEYS[:9])
        assert {o.kind for o in idx.plan(now=1)} == {OrderKind.FREE}
        assert [s.available for s in idx.stats().tiers] == [True, False]


class TestPromotion:
    def test_hit_in_lower_tier_promotes_back_to_dram(self) -> None:
        idx = index(node("a", dram=10, nvme=100))
        store(idx, KEYS[:9])
        finish(idx, idx.plan(now=1))  # 4 blocks demoted: DRAM at the low watermark
        idx.lookup(KEYS[:1], now=2)  # KEYS[0] was demoted
        assert idx.plan(now=2) == []  # no room below the low watermark: no promotion
        idx.remove(KEYS[5:7])
        idx.lookup(KEYS[:1], now=2)
        (order,) = idx.plan(now=3)
        assert order.kind is OrderKind.PROMOTE and order.src.tier is Tier.NVME and order.dst.tier is Tier.DRAM
        finish(idx, [order], now=3)
        assert [r.tier for r in idx.lookup(KEYS[:1], now=4).hits[0]] == [Tier.DRAM, Tier.NVME]


class TestHotReplication:
    def test_block_read_above_threshold_gets_dram_replicas_elsewhere(self) -> None:
        idx = index(node("a"), node("b"), node("c"), hot_reads_per_s=20, hot_window_s=1.0, max_hot_replicas=2)
        store(idx, KEYS[:2])
        for i in range(10):  # 10 reads/s: cold
            idx.lookup(KEYS[:1], now=i * 0.1)
        assert idx.plan(now=1.0) == []
        for i in range(100):  # 100 reads/s: hot
            idx.lookup(KEYS[:1], now=2 + i * 0.01)
        (order,) = idx.plan(now=3.0)
        assert order.kind is OrderKind.REPLICATE and order.dst.node != order.src.node
        finish(idx, [order], now=3.0)
        for i in range(100):
            idx.lookup(KEYS[:1], now=3 + i * 0.01)
        assert idx.plan(now=4.0) == []  # capped at max_hot_replicas
        assert len({r.node for r in idx.lookup(KEYS[:1], now=4).hits[0]}) == 2


class TestNodeLoss:
    def test_lost_node_drops_its_replicas_and_orders(self) -> None:
        idx = index(node("a", nvme=100), node("b"), replicas=2)
        store(idx, KEYS[:3])
        idx.put_start(KEYS[3:4], [MB], now=0)
        idx.add_node(node("c"))
        lost = idx.remove_node("a", now=1)
        assert lost == []
        assert all({r.node for r in h} == {"b"} for h in idx.lookup(KEYS[:3], now=1).hits)
        assert sorted(idx.remove_node("b", now=1)) == sorted(KEYS[:4])
        assert idx.lookup(KEYS[:3], now=2).hits == []
        assert [s.node for s in idx.stats().tiers] == ["c"]


class TestRebuild:
    def test_restarted_index_serves_inventory_and_avoids_its_offsets(self) -> None:
        old = index(node("a", nvme=100))
        store(old, KEYS[:9])
        finish(old, old.plan(now=1))
        inventory = [
            InventoryItem(KEYS[i], r.tier, r.offset, r.size)
            for i, hit in enumerate(old.lookup(KEYS[:9], now=2).hits)
            for r in hit
        ]
        new = index(node("a", nvme=100))
        assert new.rebuild("a", inventory, now=3) == []
        assert new.lookup(KEYS[:9], now=3).hits == old.lookup(KEYS[:9], now=3).hits
        taken = {i.offset for i in inventory if i.tier is Tier.DRAM}
        fresh = new.put_start(KEYS[20:25], [MB] * 5, now=4)
        assert not taken & {p.replicas[0].offset for p in fresh if p.replicas and p.replicas[0].tier is Tier.DRAM}
        assert new.rebuild("a", inventory[:1], now=5) == inventory[:1]  # duplicates refused


class TestOrdersRacingRemoval:
    def test_copy_finished_after_remove_is_freed(self) -> None:
        idx = index(node("a", nvme=100))
        store(idx, KEYS[:9])
        orders = idx.plan(now=1)
        idx.remove([orders[0].key])
        (leftover,) = idx.order_done(orders[0].order_id, True, now=2)
        assert leftover.kind is OrderKind.FREE and leftover.src == orders[0].dst
        assert idx.stats().tiers[1].used == 3 * MB  # the other three demotions still reserved
        assert idx.order_done(orders[0].order_id, True, now=2) == []  # idempotent


class TestCorruptReplica:
    def test_only_the_reported_replica_goes_and_the_key_can_be_placed_again(self) -> None:
        idx = index(node("a"), node("bb"), replicas=2)
        store(idx, KEYS[:2])
        (hit, _) = idx.lookup(KEYS[:2], now=1).hits
        damaged, other = hit
        elsewhere = idx.remove_replica(KEYS[0], damaged.node, damaged.tier, damaged.offset + 1)
        assert elsewhere == []  # another extent on that node is another replica
        (freed,) = idx.remove_replica(KEYS[0], damaged.node, damaged.tier, damaged.offset)
        assert (freed.kind, freed.src) == (OrderKind.FREE, damaged)
        assert idx.lookup(KEYS[:1], now=2).hits == [(other,)]
        (last,) = idx.remove_replica(KEYS[0], other.node, other.tier, other.offset)
        assert last.src == other and idx.lookup(KEYS[:2], now=3).hits == []
        assert not idx.put_start(KEYS[:1], [MB], now=4)[0].exists  # the next computation writes it again
        assert idx.remove_replica(KEYS[0], "a", Tier.DRAM, 0) == []  # pending, not a replica a reader saw
