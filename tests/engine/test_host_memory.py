"""What an engine's fixed parts hold in host memory: the figures its process's memory bound is built from."""

from __future__ import annotations

import math
from pathlib import Path

from safetensors import safe_open
from transformers import AutoConfig

from halfmoon.engine.host_memory import step_working_bytes
from tests.engine.conftest import make_engine

MIB = 1 << 20


class TestEngineHostMemory:
    def test_the_kv_cache_is_the_configured_bytes_and_the_weights_the_parameters(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama, kv_cache_bytes=8 * MIB)
        memory = engine.host_memory()
        assert memory.kv_cache == engine.cache.data.nbytes
        assert 8 * MIB - memory.block_bytes < memory.kv_cache <= 8 * MIB
        # the serving layers took the projections over (packed): all of the checkpoint is still counted
        with safe_open(str(tiny_llama / "model.safetensors"), "pt") as checkpoint:
            names = checkpoint.keys()  # a safetensors file handle is not iterable
            parameters = sum(math.prod(checkpoint.get_slice(name).get_shape()) for name in names)
        buffers = sum(b.numel() * b.element_size() for b in engine.model.buffers())
        assert memory.weights == parameters * 4 + buffers

    def test_a_step_holds_more_the_more_tokens_and_context_it_may_take(self, tiny_llama: Path) -> None:
        small = make_engine(tiny_llama, kv_cache_bytes=4 * MIB, max_model_len=1024).host_memory().step
        longer = make_engine(tiny_llama, kv_cache_bytes=4 * MIB, max_model_len=4096).host_memory().step
        wider = make_engine(tiny_llama, kv_cache_bytes=4 * MIB, max_model_len=1024, max_num_batched_tokens=512,
                            prefill_chunk_size=256).host_memory().step
        assert small < longer and small < wider
        assert small == step_working_bytes(max_num_batched_tokens=64, prefill_chunk_size=32, max_num_seqs=64,
                                           hidden_size=256, intermediate_size=256 * 8 // 3, num_heads=8,
                                           vocab_size=AutoConfig.from_pretrained(tiny_llama).vocab_size, max_model_len=1024, dtype_bytes=4)

