"""The engine's local prefix cache: full blocks addressed by content keys, reused and evicted."""

from __future__ import annotations

from pathlib import Path

from halfmoon.core.keys import BlockHasher
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.interface import RequestKV
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine, random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def keys_of(engine: LLMEngine, prompt: list[int]) -> list[bytes]:
    return BlockHasher(engine.config.block_size, engine.fingerprint.hex()).keys(prompt)


def run(engine: LLMEngine, rid: str, prompt: list[int], **options) -> tuple[list[int], int]:
    engine.add_request(rid, prompt, GREEDY, **options)
    tokens, cached = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    return tokens, cached


class TestLocalReuse:
    def test_shared_prefix_is_not_recomputed_and_output_unchanged(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama)
        (prefix, tail_a, tail_b) = random_prompts(engine.vocab_size, [80, 9, 30], seed=3)
        first, second = prefix + tail_a, prefix + tail_b
        run(engine, "a", first, block_keys=keys_of(engine, first))
        stored, evicted = engine.take_cache_events()
        assert len(stored) == len(first) // 16 and not evicted
        warm, cached = run(engine, "b", second, block_keys=keys_of(engine, second))
        assert cached == 80
        cold, cold_cached = run(make_engine(tiny_llama), "c", second)
        assert cold_cached == 0 and warm == cold

    def test_whole_prompt_cached_still_computes_the_last_token(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama)
        (prompt,) = random_prompts(engine.vocab_size, [64], seed=4)
        expected, _ = run(engine, "a", prompt, block_keys=keys_of(engine, prompt))
        again, cached = run(engine, "b", prompt, block_keys=keys_of(engine, prompt))
        assert cached == 48 and again == expected


class TestEviction:
    def test_cached_blocks_give_way_under_pressure(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama, kv_cache_blocks=10)
        prompts = random_prompts(engine.vocab_size, [64, 64, 64], seed=5)
        for i, prompt in enumerate(prompts):
            run(engine, f"r{i}", prompt, block_keys=keys_of(engine, prompt))
        stored, evicted = engine.take_cache_events()
        assert len(stored) == 12
        # 10 blocks, 5 per request (4 full + the tail): the third request takes the 2 never-used
        # blocks, then evicts the oldest chain deepest block first, so its short prefix lives longest.
        first = keys_of(engine, prompts[0])
        assert evicted == [first[3], first[2], first[1]]
        assert engine.cached_prefix_blocks(first) == 1
        assert engine.cached_prefix_blocks(keys_of(engine, prompts[2])) == 4
        assert engine.num_free_blocks == 10


class TestImportAfterLocal:
    def test_pool_blocks_continue_a_local_prefix(self, tiny_llama: Path) -> None:
        source, target = make_engine(tiny_llama), make_engine(tiny_llama)
        (prompt,) = random_prompts(source.vocab_size, [70], seed=6)
        keys = keys_of(source, prompt)
        source.add_request("p", prompt, GREEDY, prefill_only=True)
        while source.has_unfinished():
            source.step()
        blocks = source.export_kv("p")
        run(target, "warmup", prompt[:33], block_keys=keys[:2])  # target holds blocks 0-1 locally
        assert target.cached_prefix_blocks(keys) == 2
        tokens, cached = run(target, "t", prompt, block_keys=keys, kv=RequestKV(source=blocks[2:4], start_block=2))
        assert cached == 64
        expected, _ = run(make_engine(tiny_llama), "cold", prompt)
        assert tokens == expected


class TestLookupDuringAStep:
    def test_the_prefix_lookup_does_not_wait_for_the_engine_thread(self, tiny_llama: Path) -> None:
        """A request that arrived during a step must be added before the next step begins: its prefix
        lookup may not queue behind the step in progress (then the next one would start without it)."""
        import asyncio
        import threading

        from halfmoon.engine.async_engine import AsyncEngine

        async def scenario() -> tuple[int, int, bool]:
            engine = await AsyncEngine.start(lambda: make_engine(tiny_llama))
            try:
                prompt = random_prompts(1000, [70], seed=8)[0]
                keys = BlockHasher(16, engine.kv_spec.model_fingerprint).keys(prompt)
                async for _ in engine.generate("warm", prompt, GREEDY, block_keys=keys):
                    pass
                busy, free = threading.Event(), threading.Event()
                stalled = asyncio.ensure_future(engine.call(lambda e: (busy.set(), free.wait(30))))
                await asyncio.to_thread(busy.wait, 30)  # the engine thread is now held, as by a long step
                held = engine.cached_prefix_blocks(keys)
                partial = engine.cached_prefix_blocks([*keys[:2], b"not-cached", *keys[3:]])
                waiting = not stalled.done()
                free.set()
                await stalled
                return held, partial, waiting
            finally:
                engine.shutdown()

        held, partial, engine_was_held = asyncio.run(scenario())
        assert engine_was_held
        assert (held, partial) == (70 // 16, 2)
