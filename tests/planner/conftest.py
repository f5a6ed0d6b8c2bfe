"""A cost profile whose capacity is set by configuration, not by this machine's speed."""

from __future__ import annotations

from typing import Any

import pytest

from halfmoon.sim.profile import Profile, profile_from_dict

# decode steps take 20 ms + 80 ms per running request: within a TBT SLO of 200 ms an instance holds two
# requests, not three (and fewer while it prefills others)
STEP_FIXED_S, STEP_PER_REQUEST_S = 0.02, 0.08
TBT_SLO_S = 0.2
PREFILL_FIXED_S, PREFILL_PER_TOKEN_S = 0.01, 0.0001


def capped_profile_dict() -> dict[str, Any]:
    return {
        "name": "capped-by-configuration",
        "layers": 2,
        "kv_bytes_per_token": 1024,
        "decode_capacity_tokens": 1_000_000,
        "dram_cache_tokens_per_node": 1_000_000,
        "hbm_cache_tokens_per_node": 1_000_000,
        "prefill": {"samples": [[n, p, PREFILL_FIXED_S + PREFILL_PER_TOKEN_S * n]
                                for n in (1, 16, 64, 256, 1024) for p in (0, 64)]},
        "decode": {"samples": [[b, c, STEP_FIXED_S + STEP_PER_REQUEST_S * b]
                               for b in (1, 2, 4, 8, 16) for c in (100, 1000, 10000)]},
        "transfer": {"bandwidth_bytes_per_s": 1e10, "latency_s": 0.0001},
    }


@pytest.fixture(scope="session")
def capped_profile() -> Profile:
    return profile_from_dict(capped_profile_dict())
