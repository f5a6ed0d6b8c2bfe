"""Round trips and failure modes of the DRAM, NVMe and S3 tiers against real backends."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator

import pytest

from halfmoon.storage.base import BlockNotFound, StorageTier, TierFull, TierUnavailable
from halfmoon.storage.dram import ShmTier
from halfmoon.storage.nvme import DirTier
from halfmoon.storage.s3 import S3Config, S3Tier
from tests.fixtures.s3 import free_ports, s3_config, s3_server  # noqa: F401  (fixtures)


def key(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


@pytest.fixture(params=["dram", "nvme", "s3"])
async def tier(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[StorageTier]:
    if request.param == "dram":
        t: StorageTier = ShmTier(capacity=8 << 20)
    elif request.param == "nvme":
        t = DirTier(tmp_path / "nvme", capacity=8 << 20)
    else:
        t = S3Tier(request.getfixturevalue("s3_config"))
        await t.ensure_bucket()
    yield t
    await t.close()


class TestRoundTrip:
    async def test_put_get_delete(self, tier: StorageTier) -> None:
        blocks = {key(i): os.urandom(100_000 + i) for i in range(3)}
        for k, v in blocks.items():
            await tier.put(k, v)
        for k, v in blocks.items():
            assert await tier.get(k) == v
            assert await tier.contains(k)
        assert sorted(await tier.list()) == sorted(blocks)
        usage = await tier.usage()
        assert usage.blocks == 3 and usage.used >= sum(map(len, blocks.values()))
        assert await tier.delete(key(0)) is True
        assert await tier.delete(key(0)) is False
        assert not await tier.contains(key(0))
        with pytest.raises(BlockNotFound):
            await tier.get(key(0))
        assert await tier.get(key(1)) == blocks[key(1)]

    async def test_put_replaces(self, tier: StorageTier) -> None:
        await tier.put(key(7), b"a" * 1000)
        await tier.put(key(7), b"b" * 500)
        assert await tier.get(key(7)) == b"b" * 500
        assert (await tier.usage()).blocks == 1

    async def test_bad_key_is_rejected(self, tier: StorageTier) -> None:
        with pytest.raises(ValueError):
            await tier.put(b"short", b"x")


class TestCapacity:
    async def test_dram_full_raises_and_keeps_data(self) -> None:
        t = ShmTier(capacity=1 << 20)
        try:
            await t.put(key(1), b"x" * (600 << 10))
            with pytest.raises(TierFull):
                await t.put(key(2), b"y" * (600 << 10))
            assert await t.get(key(1)) == b"x" * (600 << 10)
        finally:
            await t.close()

    async def test_nvme_full_raises_and_keeps_data(self, tmp_path) -> None:
        t = DirTier(tmp_path, capacity=1000)
        await t.put(key(1), b"x" * 600)
        with pytest.raises(TierFull):
            await t.put(key(2), b"y" * 600)
        assert await t.list() == [key(1)]


class TestNvmeDurability:
    async def test_restart_sees_blocks_and_drops_temp_files(self, tmp_path) -> None:
        t = DirTier(tmp_path, capacity=1 << 20)
        await t.put(key(1), b"persisted")
        leftover = tmp_path / key(2).hex()[:2] / (key(2).hex() + ".blk.deadbeef.tmp")
        leftover.parent.mkdir(exist_ok=True)
        leftover.write_bytes(b"half a block")
        again = DirTier(tmp_path, capacity=1 << 20)
        assert await again.list() == [key(1)]
        assert await again.get(key(1)) == b"persisted"
        assert not leftover.exists()
        assert (await again.usage()).used == len(b"persisted")


class TestDramInPlace:
    async def test_reserve_is_invisible_until_commit(self) -> None:
        t = ShmTier(capacity=1 << 20)
        try:
            ext = t.reserve(key(1), 5)
            t.writable(ext)[:] = b"hello"
            assert not await t.contains(key(1))
            t.commit(key(1))
            assert await t.get(key(1)) == b"hello"
        finally:
            await t.close()

    async def test_manager_offset_evicts_stale_overlap(self) -> None:
        t = ShmTier(capacity=1 << 20, alignment=64)
        try:
            await t.put(key(1), b"a" * 128, offset=0)
            await t.put(key(2), b"b" * 64, offset=128)
            await t.put(key(3), b"c" * 100, offset=64)  # overlaps both stale blocks
            assert await t.list() == [key(3)]
            assert t.locate(key(3)).offset == 64
        finally:
            await t.close()


class TestS3:
    async def test_multipart_object_round_trip(self, s3_config: S3Config) -> None:
        t = S3Tier(s3_config)
        await t.ensure_bucket()
        big = os.urandom(12 << 20)  # above the 8 MiB multipart threshold
        await t.put(key(1), big)
        assert await t.get(key(1)) == big
        await t.close()

    async def test_prefixes_isolate(self, s3_server) -> None:
        a = S3Tier(S3Config(endpoint_url=s3_server.endpoint_url, bucket="halfmoon-test", prefix="iso-a/"))
        b = S3Tier(S3Config(endpoint_url=s3_server.endpoint_url, bucket="halfmoon-test", prefix="iso-b/"))
        await a.ensure_bucket()
        await a.put(key(1), b"only in a")
        assert await b.list() == [] and not await b.contains(key(1))
        assert await a.list() == [key(1)]

    async def test_unreachable_endpoint_is_tier_unavailable(self) -> None:
        (port,) = free_ports(1)  # nothing listens there
        t = S3Tier(S3Config(endpoint_url=f"http://127.0.0.1:{port}", bucket="b", connect_timeout_s=0.5, max_attempts=1))
        for op in (t.put(key(1), b"x"), t.get(key(1)), t.contains(key(1)), t.list(), t.usage()):
            with pytest.raises(TierUnavailable):
                await op


class TestDramBatches:
    async def test_a_batch_is_invisible_until_committed_and_replaces_older_values(self) -> None:
        t = ShmTier(capacity=1 << 20)
        try:
            await t.put(key(1), b"old")
            keys = [key(1), key(2), key(3)]
            exts = t.reserve_batch(keys, [5, 5, 5])
            for ext, data in zip(exts, (b"one..", b"two..", b"three")):
                t.writable(ext)[:] = data
            assert await t.get(key(1)) == b"old" and not await t.contains(key(2))
            assert t.commit_batch([*keys, key(9)]) == [key(9)]  # not reserved: named back, nothing done
            assert [await t.get(k) for k in keys] == [b"one..", b"two..", b"three"]
            assert (await t.usage()).used == 3 * 64  # the old value's room is free again
        finally:
            await t.close()

    async def test_a_batch_that_does_not_fit_reserves_nothing(self) -> None:
        t = ShmTier(capacity=4096, alignment=64)
        try:
            with pytest.raises(TierFull):
                t.reserve_batch([key(1), key(2)], [2048, 4096])
            assert not t.is_reserved(key(1)) and (await t.usage()).used == 0
            exts = t.reserve_batch([key(1), key(2)], [64, 64], offsets=[128, 0])  # the cache-manager's offsets
            assert [e.offset for e in exts] == [128, 0]
        finally:
            await t.close()
