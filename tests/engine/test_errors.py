"""Bad input raises a typed error and leaves the engine usable."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from halfmoon.core.errors import (
    ContextLengthError,
    DuplicateRequestError,
    InvalidRequestError,
    ModelLoadError,
    OutOfKVBlocksError,
    UnknownRequestError,
)
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine

OK = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama, max_model_len=256, kv_cache_blocks=12)


class TestBadRequests:
    @pytest.mark.parametrize(
        ("prompt", "params", "error", "message"),
        [
            ([], OK, InvalidRequestError, "empty"),
            ([1, 10**6], OK, InvalidRequestError, "outside the vocabulary"),
            ([-1], OK, InvalidRequestError, "outside the vocabulary"),
            ([1] * 250, SamplingParams(max_tokens=10), ContextLengthError, "context length of 256"),
            ([1] * 190, OK, OutOfKVBlocksError, "KV blocks"),
        ],
    )
    def test_rejected_and_engine_still_serves(self, engine, prompt, params, error, message) -> None:
        with pytest.raises(error, match=message):
            engine.add_request("bad", prompt, params)
        assert not engine.has_unfinished()
        assert engine.generate([[5, 6, 7]], OK)[0] and engine.num_free_blocks == 12

    def test_duplicate_and_unknown_ids(self, engine) -> None:
        engine.add_request("same", [1, 2], OK)
        with pytest.raises(DuplicateRequestError):
            engine.add_request("same", [3, 4], OK)
        engine.abort("same")
        with pytest.raises(UnknownRequestError):
            engine.abort("same")
        assert not engine.has_unfinished() and engine.num_free_blocks == 12

    @pytest.mark.parametrize("field", [{"max_tokens": 0}, {"top_p": 0.0}, {"temperature": -1.0}, {"top_k": -2}])
    def test_sampling_params_validate(self, field) -> None:
        with pytest.raises(ValueError):
            SamplingParams(**field)
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(msgspec.json.encode(field), type=SamplingParams)


class TestBadModelDirectory:
    def test_missing_directory(self, tmp_path: Path) -> None:
        with pytest.raises(ModelLoadError, match=r"no config\.json"):
            LLMEngine(EngineConfig(model=str(tmp_path / "nothing")))

    def test_directory_that_is_not_a_causal_lm(self, tmp_path: Path) -> None:
        (tmp_path / "config.json").write_text('{"architectures": ["BertModel"]}')
        with pytest.raises(ModelLoadError, match="supported"):
            LLMEngine(EngineConfig(model=str(tmp_path)))

    def test_unreadable_config(self, tmp_path: Path) -> None:
        (tmp_path / "config.json").write_text("{not json")
        with pytest.raises(ModelLoadError, match="JSON"):
            LLMEngine(EngineConfig(model=str(tmp_path)))

    def test_config_validation(self) -> None:
        with pytest.raises(ValueError, match="dtype"):
            EngineConfig(model="x", dtype="int8")
        with pytest.raises(ValueError, match="prefill_chunk_size"):
            EngineConfig(model="x", max_num_batched_tokens=8, prefill_chunk_size=16)
