"""Where a KV block can live in the pool, fastest first."""

from __future__ import annotations

import enum


class Tier(enum.IntEnum):
    """Storage tiers, fastest first; demotion goes to the next higher value."""

    DRAM = 0
    NVME = 1
    S3 = 2
