"""One transfer node's tiers behind a single facade: read from the fastest tier that has a block,
write to the tier the cache-manager chose, move blocks between tiers when ordered."""

from __future__ import annotations

import logging
from typing import NamedTuple

from halfmoon.core.tiers import Tier
from halfmoon.storage.base import BlockNotFound, Buffer, StorageTier, TierUnavailable
from halfmoon.storage.dram import ShmTier

log = logging.getLogger(__name__)


class StoredBlock(NamedTuple):
    """An inventory entry: ``offset`` is the DRAM segment offset, -1 in other tiers."""

    key: bytes
    tier: Tier
    offset: int
    size: int


class NodeStore:
    """Contract: ``read`` tries DRAM, then NVMe, then S3, treating an unavailable tier as a miss
    (and recording it in ``unavailable``); ``move`` copies then deletes, so a block is never
    lost by a failed move; a missing tier raises ``KeyError`` naming it."""

    def __init__(self, dram: ShmTier, nvme: StorageTier | None = None, s3: StorageTier | None = None) -> None:
        self.dram = dram
        self.tiers: dict[Tier, StorageTier] = {Tier.DRAM: dram}
        if nvme is not None:
            self.tiers[Tier.NVME] = nvme
        if s3 is not None:
            self.tiers[Tier.S3] = s3
        self.unavailable: set[Tier] = set()

    def tier(self, tier: Tier) -> StorageTier:
        try:
            return self.tiers[tier]
        except KeyError:
            raise KeyError(f"tier {tier.name} is not configured on this node") from None

    async def read(self, key: bytes) -> Buffer:
        """The block's bytes; a zero-copy view when it is in DRAM."""
        if await self.dram.contains(key):
            return self.dram.view(key)
        for tier in (Tier.NVME, Tier.S3):
            if tier not in self.tiers:
                continue
            try:
                data = await self.tiers[tier].get(key)
            except BlockNotFound:
                continue
            except TierUnavailable as exc:
                self._mark(tier, exc)
                continue
            self.unavailable.discard(tier)
            return data
        raise BlockNotFound([key])

    async def write(self, key: bytes, data: Buffer, tier: Tier = Tier.DRAM, offset: int | None = None) -> None:
        if tier is Tier.DRAM:
            await self.dram.put(key, data, offset)
            return
        try:
            await self.tier(tier).put(key, data)
        except TierUnavailable as exc:
            self._mark(tier, exc)
            raise
        self.unavailable.discard(tier)

    async def move(self, key: bytes, src: Tier, dst: Tier, offset: int | None = None, keep_src: bool = False) -> None:
        """Copy ``key`` from ``src`` to ``dst`` (at ``offset`` in DRAM), then drop the source unless kept."""
        data = await self.tier(src).get(key)
        await self.write(key, data, dst, offset)
        if not keep_src:
            await self.tier(src).delete(key)

    async def delete(self, key: bytes, tier: Tier | None = None) -> bool:
        """Remove ``key`` from one tier, or from every tier when ``tier`` is None."""
        found = False
        for t in [tier] if tier is not None else list(self.tiers):
            try:
                found |= await self.tier(t).delete(key)
            except TierUnavailable as exc:
                self._mark(t, exc)
        return found

    async def inventory(self) -> list[StoredBlock]:
        """Every block held, for rebuilding a restarted cache-manager's index."""
        out = [StoredBlock(k, Tier.DRAM, ext.offset, ext.size) for k, ext in self.dram.inventory()]
        for tier in (Tier.NVME, Tier.S3):
            if tier not in self.tiers:
                continue
            try:
                sizes = await self.tiers[tier].sizes()
            except TierUnavailable as exc:
                self._mark(tier, exc)
                continue
            out += [StoredBlock(k, tier, -1, size) for k, size in sizes.items()]
        return out

    def _mark(self, tier: Tier, exc: Exception) -> None:
        if tier not in self.unavailable:
            log.warning("tier %s unavailable, serving from the others: %s", tier.name, exc)
        self.unavailable.add(tier)

    async def close(self) -> None:
        for tier in self.tiers.values():
            await tier.close()
