"""Cost-model profiles (one per model and hardware), loaded from JSON files.

A profile gives prefill and decode timings either as measured samples or as the analytic
derivation the samples follow (the paper's Equation 1 for prefill; bytes moved over HBM
bandwidth for decode). Derivations are turned into a grid of samples and fitted exactly like
measurements, so both routes end in the same least-squares cost models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from halfmoon.policy.cost import CostModels, DecodeCostModel, PrefillCostModel, TransferModel

PROFILE_DIR = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = "llama3-70b-8xa800"

_PREFILL_GRID = (256, 1024, 4096, 8192, 16384, 32768, 65536, 131072)
_DECODE_BATCH = (1, 8, 32, 64, 128)
_DECODE_CONTEXT = (1_000, 50_000, 200_000, 600_000, 1_200_000)


class ProfileError(ValueError):
    """A profile file is missing a field or has an unusable value."""


@dataclass(frozen=True)
class Profile:
    name: str
    layers: int
    kv_bytes_per_token: int
    decode_capacity_tokens: int
    dram_cache_tokens_per_node: int
    hbm_cache_tokens_per_node: int
    cost: CostModels

    def __post_init__(self) -> None:
        for field in ("layers", "kv_bytes_per_token", "decode_capacity_tokens",
                      "dram_cache_tokens_per_node", "hbm_cache_tokens_per_node"):
            if getattr(self, field) <= 0:
                raise ProfileError(f"profile {self.name}: {field} must be positive")

    def handoff_seconds(self, tokens: int) -> float:
        """KV hand-off to decode streams layer by layer during prefill; only the last layer is exposed."""
        return self.cost.transfer.seconds(tokens / self.layers)


def equation1_samples(spec: dict[str, float]) -> list[tuple[float, float, float]]:
    layers, d, a, b = spec["layers"], spec["hidden"], spec["a"], spec["b"]
    rate = spec["peak_flops"] * spec["mfu"]
    out = []
    for n in _PREFILL_GRID:
        for p in (0, n // 4, n // 2, 3 * n // 4):
            flops = layers * (a * (n * n - p * p) * d + b * (n - p) * d * d)
            out.append((float(n - p), float(p), spec["overhead_s"] + flops / rate))
    return out


def bandwidth_samples(spec: dict[str, float], kv_bytes_per_token: int) -> list[tuple[float, float, float]]:
    rate = spec["hbm_bytes_per_s"] * spec["efficiency"]
    fixed = spec["fixed_s"] + spec["weight_bytes"] / rate
    return [
        (float(bs), float(ctx), fixed + bs * spec["per_request_s"] + ctx * kv_bytes_per_token / rate)
        for bs in _DECODE_BATCH
        for ctx in _DECODE_CONTEXT
    ]


def profile_from_dict(raw: dict[str, Any]) -> Profile:
    try:
        name = raw["name"]
        kv = int(raw["kv_bytes_per_token"])
        pre, dec, xfer = raw["prefill"], raw["decode"], raw["transfer"]
        pre_samples = pre["samples"] if "samples" in pre else equation1_samples(pre["equation1"])
        dec_samples = dec["samples"] if "samples" in dec else bandwidth_samples(dec["bandwidth"], kv)
        cost = CostModels(
            prefill=PrefillCostModel.fit(pre_samples),
            decode=DecodeCostModel.fit(dec_samples),
            transfer=TransferModel(float(kv), float(xfer["bandwidth_bytes_per_s"]), float(xfer["latency_s"])),
        )
        return Profile(
            name=name,
            layers=int(raw["layers"]),
            kv_bytes_per_token=kv,
            decode_capacity_tokens=int(raw["decode_capacity_tokens"]),
            dram_cache_tokens_per_node=int(raw["dram_cache_tokens_per_node"]),
            hbm_cache_tokens_per_node=int(raw["hbm_cache_tokens_per_node"]),
            cost=cost,
        )
    except (KeyError, TypeError) as exc:
        raise ProfileError(f"profile is missing or has a malformed field: {exc}") from None


def load_profile(name_or_path: str | Path = DEFAULT_PROFILE) -> Profile:
    """Load a bundled profile by name or any profile file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise ProfileError(f"no profile at {path}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not JSON ({exc})") from None
    return profile_from_dict(raw)
