"""Building the conductor's placement policy from its configuration."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from halfmoon.services.conductor.kv_index import LiveBlockIndex
from halfmoon.services.conductor.kv_placement import KVCentricPlacement
from halfmoon.services.conductor.placement import LeastLoaded, PlacementPolicy
from halfmoon.kv.hashing import BlockHasher, Namespace
from halfmoon.policy.admission import make_admission
from halfmoon.policy.cost import CostModels, DecodeCostModel, OnlineFitter, PrefillCostModel, TransferModel
from halfmoon.policy.decode import SloAwareDecode
from halfmoon.policy.prefill import PREFILL_POLICIES, make_prefill_policy
from halfmoon.policy.scheduler import KVCentricScheduler
from halfmoon.policy.state import SLO

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class PolicySettings:
    """The scheduling part of the conductor's config (mixed into ConductorConfig)."""

    placement: str = field(default="auto", metadata={
        "help": "kv-centric, least-loaded, or auto (kv-centric when --model-dir is given)"})
    prefill_policy: str = field(default="global-cache-aware", metadata={"help": f"one of {sorted(PREFILL_POLICIES)}"})
    admission: str = field(default="predictive", metadata={"help": "none, early or predictive"})
    ttft_slo_s: float = field(default=30.0, metadata={"help": "TTFT SLO; predicted misses are rejected early"})
    tbt_slo_s: float = field(default=0.2, metadata={"help": "TBT SLO the decode choice keeps to"})
    model_dir: str = field(default="", metadata={"help": "model directory (for block keys; kv-centric only)"})
    dtype: str = field(default="float32", metadata={"help": "KV dtype of the prefill instances"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block, as on the prefill instances"})
    prefill_tokens_per_s: float = field(default=8000.0, metadata={"help": "prior prefill speed until measured"})
    decode_step_s: float = field(default=0.01, metadata={"help": "prior decode step time of a batch of one"})
    transfer_bytes_per_s: float = field(default=2e9, metadata={"help": "pool-to-instance KV bandwidth"})

    def check_policy(self) -> None:
        if self.placement not in ("auto", "kv-centric", "least-loaded"):
            raise ValueError(f"placement must be auto, kv-centric or least-loaded, got {self.placement!r}")
        if self.placement == "kv-centric" and not self.model_dir:
            raise ValueError("kv-centric placement needs --model-dir (HALFMOON_MODEL_DIR) to compute block keys")
        SLO(self.ttft_slo_s, self.tbt_slo_s)
        if min(self.prefill_tokens_per_s, self.decode_step_s, self.transfer_bytes_per_s, self.block_size) <= 0:
            raise ValueError("cost priors and block_size must be positive")


def build_placement(settings: PolicySettings) -> tuple[PlacementPolicy, LiveBlockIndex, OnlineFitter | None]:
    """The placement policy, the block index it reads, and the prefill cost fitter to feed."""
    index = LiveBlockIndex()
    if settings.placement == "least-loaded" or (settings.placement == "auto" and not settings.model_dir):
        return LeastLoaded(), index, None
    from halfmoon.engine.loader import model_fingerprint  # heavy import, only when needed

    dtype = getattr(torch, settings.dtype)
    fingerprint = model_fingerprint(Path(settings.model_dir), dtype).hex()
    config = json.loads((Path(settings.model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    bytes_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * _DTYPE_BYTES[
        settings.dtype]
    prior = PrefillCostModel((0.0, 1.0 / settings.prefill_tokens_per_s, 0.0, 0.0))
    fitter = OnlineFitter(PrefillCostModel.fit, prior)
    cost = CostModels(prefill=fitter,  # type: ignore[arg-type]  # duck-typed: predict(new, cached)
                      decode=DecodeCostModel((settings.decode_step_s, 0.0, 1e-8)),
                      transfer=TransferModel(bytes_per_token, settings.transfer_bytes_per_s, 0.001))
    slo = SLO(settings.ttft_slo_s, settings.tbt_slo_s)
    scheduler = KVCentricScheduler(make_prefill_policy(settings.prefill_policy, cost, slo),
                                   make_admission(settings.admission, SloAwareDecode(cost.decode, slo)), slo)

    def hasher(salt: str | None) -> BlockHasher:
        return BlockHasher(settings.block_size, Namespace(fingerprint, salt))

    return KVCentricPlacement(scheduler, hasher, index, settings.block_size), index, fitter
