from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from halfmoon.cli.model_tools import make_tiny_model
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.kernel_build import KERNELS
from halfmoon.protocol.sampling import SamplingParams


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


def make_engine(model: Path, **overrides: object) -> LLMEngine:
    settings: dict[str, object] = dict(dtype="float32", block_size=16, max_num_batched_tokens=64, prefill_chunk_size=32)
    settings.update(overrides)
    return LLMEngine(EngineConfig(model=str(model), **settings))  # type: ignore[arg-type]


def tokens_and_logprobs(engine: LLMEngine, prompts: list[list[int]],
                        params: SamplingParams) -> list[tuple[list[int], list[float]]]:
    """Every prompt's tokens and logprobs, the prompts run together to the end."""
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    results: dict[str, tuple[list[int], list[float]]] = {f"r{i}": ([], []) for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id][0].extend(out.new_token_ids)
            results[out.request_id][1].extend(out.new_logprobs)
    return list(results.values())


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def kernel_sources_alone(folder: Path) -> Path:
    """A copy of the kernels' sources in ``folder``, without the libraries an install may have put beside them."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in (*KERNELS.glob("*.c"), *KERNELS.glob("*.h")):
        shutil.copy(source, folder)
    return folder
