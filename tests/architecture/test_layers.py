"""The package's layers point down only: a module may import its own layer and the ones below it.

The order is the architecture (docs/ARCHITECTURE.md): the KV identity and typed errors at the
bottom, then the wire messages, telemetry and pure policies, the engine, the pool (storage tiers,
then the pool index, then the data plane), the service base, and on top the services, the
simulator and the command line. Imports inside functions count too: a lazy import is still a
dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.conftest import REPO_ROOT

LAYERS: tuple[tuple[str, ...], ...] = (
    ("halfmoon.core",),
    ("halfmoon.protocol", "halfmoon.telemetry", "halfmoon.policy"),
    ("halfmoon.engine",),
    ("halfmoon.storage",),
    ("halfmoon.kv",),
    ("halfmoon.transfer",),
    ("halfmoon.service",),
    ("halfmoon.services", "halfmoon.sim", "halfmoon.deploy", "halfmoon.cli"),
)
SOURCE_ROOTS = (REPO_ROOT / "shared", REPO_ROOT / "services")


class Import(NamedTuple):
    module: str
    line: int
    target: str


def layer_of(module: str) -> int:
    for level, packages in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return level
    raise LookupError(f"{module} is in no layer: add its package to LAYERS")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, module: str) -> list[Import]:
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(module, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append(Import(module, node.lineno, base))
    return [i for i in found if i.target == "halfmoon" or i.target.startswith("halfmoon.")]


def all_imports(roots: tuple[Path, ...] = SOURCE_ROOTS) -> list[Import]:
    out = []
    for root in roots:
        for path in sorted((root / "halfmoon").rglob("*.py")):
            out += imports_of(path, module_name(path, root))
    return out


def upward(imports: list[Import]) -> list[str]:
    return [f"{i.module}:{i.line} imports {i.target} (layer {layer_of(i.target)} > {layer_of(i.module)})"
            for i in imports if i.target != "halfmoon" and layer_of(i.target) > layer_of(i.module)]


class TestLayers:
    def test_every_module_is_in_a_layer(self):
        for imp in all_imports():
            layer_of(imp.module)

    def test_imports_point_down_only(self):
        assert upward(all_imports()) == []

    def test_an_upward_import_is_caught(self, tmp_path):
        """The check itself can fail: a core module that imports the engine is reported."""
        core = tmp_path / "halfmoon" / "core"
        core.mkdir(parents=True)
        (core / "bad.py").write_text("def f():\n    from halfmoon.engine.engine import LLMEngine\n")
        assert upward(all_imports((tmp_path,))) == [
            "halfmoon.core.bad:2 imports halfmoon.engine.engine (layer 2 > 0)"]

    @pytest.mark.parametrize("module", ["halfmoon.services.conductor.service",
                                        "halfmoon.services.cache_manager.service",
                                        "halfmoon.services.transfer.service"])
    def test_pool_and_control_plane_do_not_import_torch(self, module):
        """The conductor learns the KV identity from heartbeats, not from the model; the pool moves bytes."""
        import subprocess
        import sys

        code = f"import sys, {module}; print('torch' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "False"
