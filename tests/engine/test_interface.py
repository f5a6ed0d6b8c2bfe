"""The engine seam: services reach an engine through ``Engine`` alone, and a request's KV in and out is
one ``RequestKV``, checked when the request is added."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from halfmoon.core.errors import InvalidRequestError, UnknownRequestError
from halfmoon.engine.async_engine import AsyncEngine
from halfmoon.engine.interface import Engine, RequestKV
from halfmoon.protocol.sampling import SamplingParams
from tests.architecture.test_layers import all_imports
from tests.conftest import REPO_ROOT
from tests.engine.conftest import make_engine, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
ENGINE_SERVICES = ("halfmoon.services.prefill", "halfmoon.services.decode", "halfmoon.services.aggregated")


class TestServicesSeeTheInterfaceOnly:
    def test_the_engine_running_services_import_nothing_of_the_engine_but_its_interface(self) -> None:
        reached = {(i.module, i.target) for i in all_imports()
                   if i.module.startswith(ENGINE_SERVICES) and i.target.startswith("halfmoon.engine")}
        assert reached and {target for _, target in reached} == {"halfmoon.engine.interface"}

    def test_in_the_runtime_only_the_worker_builds_an_engine(self) -> None:
        """The worker chooses and starts the engine; every other runtime module uses the interface."""
        builders = {i.module for i in all_imports() if i.module.startswith("halfmoon.runtime")
                    and i.target.startswith("halfmoon.engine") and i.target != "halfmoon.engine.interface"}
        assert builders == {"halfmoon.runtime.worker"}

    def test_no_service_or_runtime_module_runs_code_on_the_engine_thread(self) -> None:
        """``AsyncEngine.call`` is no part of ``Engine``: a caller that needs the engine asks by method."""
        assert not hasattr(Engine, "call")
        calls = []
        for folder in (REPO_ROOT / "services" / "halfmoon" / "services", REPO_ROOT / "shared" / "halfmoon" / "runtime"):
            for path in folder.rglob("*.py"):
                for node in ast.walk(ast.parse(path.read_text())):
                    if isinstance(node, ast.Attribute) and node.attr == "call" and (
                            isinstance(node.value, ast.Attribute) and node.value.attr == "engine"):
                        calls.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
        assert calls == []

    def test_halfmoons_engine_implements_every_method(self) -> None:
        assert issubclass(AsyncEngine, Engine) and not AsyncEngine.__abstractmethods__


class TestRequestKVIsCheckedInOnePlace:
    @pytest.mark.parametrize("fields, message", [
        (dict(start_block=-1), "block indexes are >= 0"),
        (dict(export_prompt_from=-2), "block indexes are >= 0"),
        (dict(sink_from_block=2), "give the sink too"),
    ])
    def test_a_combination_that_means_nothing_is_refused_when_made(self, fields: dict, message: str) -> None:  # type: ignore[type-arg]
        with pytest.raises(InvalidRequestError, match=message):
            RequestKV(**fields)

    def test_a_sink_streams_prefill_only_requests(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama)
        (prompt,) = random_prompts(engine.vocab_size, [40], seed=1)
        with pytest.raises(InvalidRequestError, match="prefill-only"):
            engine.add_request("r", prompt, GREEDY, kv=RequestKV(sink=lambda layer, payloads: None))
        assert not engine.has_unfinished()

    def test_imported_kv_must_leave_the_last_token_to_compute(self, tiny_llama: Path) -> None:
        engine = make_engine(tiny_llama)
        (prompt,) = random_prompts(engine.vocab_size, [32], seed=2)
        engine.add_request("p", prompt, GREEDY, prefill_only=True)
        while engine.has_unfinished():
            engine.step()
        blocks = engine.export_kv("p")  # both blocks: every prompt token
        with pytest.raises(InvalidRequestError, match="last token to compute"):
            engine.add_request("d", prompt, GREEDY, kv=RequestKV(source=blocks))
        with pytest.raises(InvalidRequestError, match="last token to compute"):
            engine.add_request("d", prompt, GREEDY, kv=RequestKV(source=blocks[1:], start_block=1))
        engine.add_request("d", prompt, GREEDY, output_token_ids=[7], kv=RequestKV(source=blocks))
        assert engine.has_unfinished()


class TestExportThroughTheInterface:
    async def test_export_kv_gives_the_computed_blocks_asked_for_until_release(
            self, tiny_llama: Path) -> None:
        engine: Engine = await AsyncEngine.start(lambda: make_engine(tiny_llama))
        try:
            (prompt,) = random_prompts(1000, [40], seed=3)
            outputs = [out async for out in engine.generate("p", prompt, GREEDY, prefill_only=True)]
            assert len(outputs) == 1
            every = await engine.export_kv("p")
            assert len(every) == 3  # 40 tokens: two full blocks and a partial one
            assert await engine.export_kv("p", 1, 2) == every[1:2]
            assert await engine.export_kv("p", 2, 10) == every[2:]  # only what is computed
            await engine.release("p")
            with pytest.raises(UnknownRequestError):
                await engine.export_kv("p")
            with pytest.raises(UnknownRequestError):  # released once, gone
                await engine.release("p")
        finally:
            engine.shutdown()
