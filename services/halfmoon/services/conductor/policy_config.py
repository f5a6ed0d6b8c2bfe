"""Building the conductor's placement policy from its configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from halfmoon.core.kv_spec import KVSpec
from halfmoon.policy.admission import make_admission
from halfmoon.policy.calibration import TTFTCalibration
from halfmoon.policy.cost import CostModels, DecodeCostModel, OnlineFitter, PrefillCostModel, TransferModel
from halfmoon.policy.cpp import CppPolicy, CppSettings
from halfmoon.policy.decode import SloAwareDecode
from halfmoon.policy.prefill import PREFILL_POLICIES, make_prefill_policy
from halfmoon.policy.scheduler import KVCentricScheduler
from halfmoon.policy.state import SERVING_SLO, SLO
from halfmoon.runtime.config import require_for, setting
from halfmoon.services.conductor.kv_index import LiveBlockIndex
from halfmoon.services.conductor.kv_placement import KVCentricPlacement
from halfmoon.services.conductor.placement import LeastLoaded, PlacementPolicy


@dataclass(frozen=True)
class PolicySettings:
    """The scheduling part of the conductor's config (mixed into ConductorConfig)."""

    placement: str = field(default="kv-centric", metadata={
        "help": "kv-centric (block keys from the KV spec engine instances advertise) or least-loaded"})
    prefill_policy: str = field(default="global-cache-aware", metadata={"help": f"one of {sorted(PREFILL_POLICIES)}"})
    admission: str = field(default="predictive", metadata={"help": "none, early or predictive"})
    ttft_slo_s: float = field(default=SERVING_SLO.ttft_s, metadata={
        "help": "TTFT SLO; predicted misses are rejected early"})
    tbt_slo_s: float = field(default=SERVING_SLO.tbt_s, metadata={
        "help": "TBT SLO the decode choice keeps to (the engines' step target with tbt_chunking)"})
    prefill_tokens_per_s: float = field(default=8000.0, metadata={"help": "prior prefill speed until measured"})
    decode_step_s: float = field(default=0.01, metadata={"help": "prior decode step time of a batch of one"})
    decode_step_per_seq_s: float = field(default=0.0005, metadata={
        "help": "prior growth of the decode step per sequence in the batch"})
    learn_decode_cost: bool = field(default=True, metadata={
        "help": "learn the decode step time from the steps decoding instances report, prefill chunks sharing "
                "an aggregated instance's steps included (off: the two priors above alone)"})
    prefill_interference: bool = field(default=False, metadata={
        "help": "judge an aggregated instance's TBT also by its decoding steps that carried a prefill chunk, "
                "learned apart from those that did not (with learn_decode_cost)"})
    transfer_bytes_per_s: float = field(default=2e9, metadata={"help": "pool-to-instance KV bandwidth"})
    handoff_overhead_s: float = field(default=0.02, metadata={
        "help": "fixed cost of handing a request off from a prefill to a decode instance, weighed against "
                "serving it whole where aggregated instances run beside a pair (policy/disaggregation.py)"})
    ttft_calibration_s: float = field(default=0.0, metadata={
        "help": "calibrate predicted TTFTs to those delivered in the last this many seconds, e.g. 120 "
                "(0: off, the default; docs/BENCHMARKS.md, Predictions and admission)"})
    cpp_stages: int = field(default=0, metadata={
        "help": "chunked pipeline-parallel prefill over this many prefill instances (0: off)"})
    cpp_min_tokens: int = field(default=8192, metadata={"help": "shortest prompt a pipeline may prefill"})
    cpp_chunk_tokens: int = field(default=512, metadata={"help": "pipeline chunk size the cost model assumes"})
    cpp_hop_bytes_per_token: int = field(default=16384, metadata={
        "help": "hidden-state bytes per token between stages (hidden size x dtype bytes)"})
    cpp_rescue_only: bool = field(default=True, metadata={
        "help": "pipeline only prompts whose best single instance is predicted to miss the TTFT SLO "
                "(else whenever a pipeline is predicted faster)"})

    def check_policy(self) -> None:
        if self.placement not in ("kv-centric", "least-loaded"):
            raise ValueError(f"placement must be kv-centric or least-loaded, got {self.placement!r}")
        SLO(self.ttft_slo_s, self.tbt_slo_s)
        if min(self.prefill_tokens_per_s, self.decode_step_s, self.transfer_bytes_per_s) <= 0:
            raise ValueError("cost priors must be positive")
        if self.handoff_overhead_s < 0:
            raise ValueError(f"handoff_overhead_s must be >= 0, got {self.handoff_overhead_s}")
        if self.ttft_calibration_s < 0:
            raise ValueError(f"ttft_calibration_s must be >= 0, got {self.ttft_calibration_s}")
        if self.decode_step_per_seq_s < 0:
            raise ValueError(f"decode_step_per_seq_s must be >= 0, got {self.decode_step_per_seq_s}")
        require_for(self, ["prefill_policy", "admission", "cpp_stages"], self.placement == "kv-centric",
                    f"{setting('placement')} kv-centric")
        require_for(self, ["cpp_min_tokens", "cpp_chunk_tokens", "cpp_hop_bytes_per_token", "cpp_rescue_only"],
                    self.cpp_stages > 0, f"{setting('cpp_stages')} > 0")
        if self.cpp_stages:
            self.cpp_settings().check()

    def cpp_settings(self) -> CppSettings:
        return CppSettings(self.cpp_stages, self.cpp_chunk_tokens, self.cpp_min_tokens, self.cpp_hop_bytes_per_token,
                           self.ttft_slo_s if self.cpp_rescue_only else 0.0)


class BuiltPlacement(NamedTuple):
    """The placement policy, the block index it reads, and the cost fitters to feed (None: not learned).
    ``decode_cost`` learns from the decoding steps instances report; with ``shared_cost`` (setting
    ``prefill_interference``) from those no prefill chunk shared, and ``shared_cost`` from those one did,
    else from both, so TBT admission sees prefill interference on average."""

    policy: PlacementPolicy
    block_index: LiveBlockIndex
    prefill_cost: OnlineFitter | None = None
    decode_cost: OnlineFitter | None = None
    shared_cost: OnlineFitter | None = None


def build_placement(settings: PolicySettings) -> BuiltPlacement:
    index = LiveBlockIndex()
    if settings.placement == "least-loaded":
        return BuiltPlacement(LeastLoaded(), index)
    fitter = OnlineFitter(PrefillCostModel.fit, PrefillCostModel((0.0, 1.0 / settings.prefill_tokens_per_s, 0.0, 0.0)))
    decode_prior = DecodeCostModel((settings.decode_step_s, settings.decode_step_per_seq_s, 1e-8))
    decode_fitter = OnlineFitter(DecodeCostModel.fit, decode_prior) if settings.learn_decode_cost else None
    shared_fitter = (OnlineFitter(DecodeCostModel.fit, decode_prior)
                     if settings.learn_decode_cost and settings.prefill_interference else None)
    slo = SLO(settings.ttft_slo_s, settings.tbt_slo_s)
    calibration = TTFTCalibration(settings.ttft_calibration_s) if settings.ttft_calibration_s else None

    def make_scheduler(spec: KVSpec) -> KVCentricScheduler:
        cost = CostModels(prefill=fitter,  # type: ignore[arg-type]  # duck-typed: predict(new, cached)
                          decode=decode_prior if decode_fitter is None else decode_fitter,  # type: ignore[arg-type]  # duck-typed: predict(batch, context)
                          transfer=TransferModel(spec.bytes_per_token, settings.transfer_bytes_per_s, 0.001))
        decode = SloAwareDecode(cost.decode, slo, idle_qualifies=True,
                                shared_cost=shared_fitter)  # type: ignore[arg-type]  # duck-typed: predict(batch, context)
        return KVCentricScheduler(make_prefill_policy(settings.prefill_policy, cost, slo),
                                  make_admission(settings.admission, decode), slo,
                                  CppPolicy(cost, settings.cpp_settings()) if settings.cpp_stages else None,
                                  calibration)

    return BuiltPlacement(KVCentricPlacement(make_scheduler, index, calibration, pools_steps=shared_fitter is None,
                                             handoff_overhead_s=settings.handoff_overhead_s),
                          index, fitter, decode_fitter,
                          shared_fitter)
