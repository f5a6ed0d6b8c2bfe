"""Load a Hugging Face causal LM of the Llama family from a local directory."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from halfmoon.core.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"}
)
_FINGERPRINT_SAMPLE = 1 << 20


class LoadedModel(NamedTuple):
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    fingerprint: bytes
    name: str


def model_fingerprint(directory: Path, dtype: torch.dtype) -> bytes:
    """SHA-256 over the config, the KV dtype and samples of every weight file.

    Cheap enough for large checkpoints (it reads 2 MiB per file), yet two different
    checkpoints or dtypes never share KV blocks.
    """
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    digest.update(str(dtype).encode())
    for weights in sorted(directory.glob("*.safetensors")) + sorted(directory.glob("*.bin")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as handle:
            digest.update(handle.read(_FINGERPRINT_SAMPLE))
            handle.seek(max(0, size - _FINGERPRINT_SAMPLE))
            digest.update(handle.read(_FINGERPRINT_SAMPLE))
    return digest.digest()


def load_model(path: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path!r} is not a model directory: no config.json there")
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config_file} is not readable JSON: {exc}") from exc
    if not SUPPORTED_ARCHITECTURES.intersection(architectures):
        raise ModelLoadError(
            f"{path!r} holds {architectures or 'no architecture'}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load weights from {path!r}: {exc}") from exc
    model.to(device).eval()  # type: ignore[arg-type]  # transformers types to() by functools.wraps: self unbound
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError):
        tokenizer = None
    return LoadedModel(model, tokenizer, model_fingerprint(directory, dtype), directory.name)
