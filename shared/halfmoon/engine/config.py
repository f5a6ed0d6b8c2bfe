"""The engine's one configuration object."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
log = logging.getLogger(__name__)


@cache
def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX); without it bfloat16 is emulated and slow."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return not _CPU_BF16_FLAGS.isdisjoint(flags)


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes an engine; validated once, here.

    ``dtype`` ``auto`` is bfloat16 where the device computes it natively (a CUDA GPU that
    supports it, a CPU with AVX512-BF16 or AMX), else float32. ``kv_cache_blocks`` fixes the paged cache size; when 0 it is derived from
    ``kv_cache_bytes``. ``max_num_batched_tokens`` is the per-step token budget shared
    by decode tokens and prefill chunks; ``prefill_chunk_size`` caps one sequence's
    share of it, so long prompts are computed in chunks. ``step_time_target_s`` (0: off) keeps
    steps that carry decodes to about that many seconds by shrinking their prompt chunks
    (``StepBudget``): a TBT SLO for engines that prefill and decode alike.
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_blocks: int = 0
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    step_time_target_s: float = 0.0
    max_model_len: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a local model directory")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not (math.isfinite(self.step_time_target_s) and self.step_time_target_s >= 0):
            raise ValueError(f"step_time_target_s must be a finite number >= 0, got {self.step_time_target_s}")
        if self.kv_cache_blocks < 0 or self.kv_cache_bytes < 0 or self.max_model_len < 0:
            raise ValueError("cache sizes and max_model_len must not be negative")
        if self.prefill_chunk_size > self.max_num_batched_tokens:
            raise ValueError("prefill_chunk_size must not exceed max_num_batched_tokens")
        if self.dtype == "bfloat16" and self.torch_device.type == "cpu" and not cpu_has_bf16():
            log.warning("dtype bfloat16 on a CPU without AVX512-BF16 or AMX: every matmul is emulated, several "
                        "times slower than float32 (dtype auto picks float32 here)")

    @property
    def resolved_dtype(self) -> str:
        """``dtype`` with ``auto`` decided for this machine's device."""
        if self.dtype != "auto":
            return self.dtype
        if self.torch_device.type == "cuda":
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
        return "bfloat16" if cpu_has_bf16() else "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.resolved_dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
