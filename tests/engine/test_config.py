"""EngineConfig's dtype choice on CPUs with and without native bfloat16."""

from __future__ import annotations

import logging

import pytest

from halfmoon.engine import config as config_module
from halfmoon.engine.config import EngineConfig


@pytest.mark.parametrize("native", [True, False])
class TestDtypeOnCPU:
    def test_auto_is_bfloat16_only_where_the_cpu_computes_it(self, monkeypatch, native):
        monkeypatch.setattr(config_module, "cpu_has_bf16", lambda: native)
        assert EngineConfig("m", device="cpu").resolved_dtype == ("bfloat16" if native else "float32")

    def test_bfloat16_asked_for_without_native_support_is_kept_and_warned_about(self, monkeypatch, caplog, native):
        monkeypatch.setattr(config_module, "cpu_has_bf16", lambda: native)
        with caplog.at_level(logging.WARNING, logger=config_module.__name__):
            config = EngineConfig("m", dtype="bfloat16", device="cpu")
        assert config.resolved_dtype == "bfloat16"
        warned = [r for r in caplog.records if "emulated" in r.getMessage()]
        assert bool(warned) != native
