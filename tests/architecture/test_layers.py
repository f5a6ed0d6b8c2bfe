"""The package's layers point down only: a module may import its own layer and the ones below it.

The order is the architecture (docs/ARCHITECTURE.md): the KV identity and typed errors at the
bottom, then the wire messages, telemetry and pure policies, the engine, the pool (storage tiers,
then the pool index, then the data plane), the service runtime, the simulator, the launcher and the
command line, and on top the services: everything under ``shared/`` is below every service. Imports
inside functions and under ``TYPE_CHECKING`` count too: a lazy or typing-only import is still a
dependency, and no two modules may depend on each other, directly or around a circle.
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
    ("halfmoon.runtime",),
    ("halfmoon.sim", "halfmoon.deploy", "halfmoon.cli", "halfmoon.connectors"),
    ("halfmoon.services",),
)
SOURCE_ROOTS = (REPO_ROOT / "shared", REPO_ROOT / "services")


class Import(NamedTuple):
    module: str
    line: int
    target: str
    names: tuple[str, ...] = ()  # ``from target import names``


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
            found.append(Import(module, node.lineno, base, tuple(alias.name for alias in node.names)))
    return [i for i in found if i.target == "halfmoon" or i.target.startswith("halfmoon.")]


def all_imports(roots: tuple[Path, ...] = SOURCE_ROOTS) -> list[Import]:
    out = []
    for root in roots:
        for path in sorted((root / "halfmoon").rglob("*.py")):
            out += imports_of(path, module_name(path, root))
    return out


def circles(imports: list[Import]) -> list[list[str]]:
    """Every import circle among the modules, each as the modules around it; ``from package import
    module`` is an edge to that module."""
    modules = {i.module for i in imports}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for i in imports:
        targets = {f"{i.target}.{name}" for name in i.names if f"{i.target}.{name}" in modules} or {i.target}
        graph[i.module] |= {t for t in targets if t in modules and t != i.module}
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def into_services(imports: list[Import]) -> list[str]:
    return [f"{i.module}:{i.line} imports {i.target}" for i in imports
            if not i.module.startswith("halfmoon.services") and
            (i.target.startswith("halfmoon.services") or (i.target == "halfmoon" and "services" in i.names))]


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

    def test_no_import_circles(self):
        assert circles(all_imports()) == []

    def test_an_import_circle_is_caught(self, tmp_path):
        """A circle hidden behind TYPE_CHECKING is still a circle."""
        engine = tmp_path / "halfmoon" / "engine"
        engine.mkdir(parents=True)
        (engine / "a.py").write_text("from halfmoon.engine.b import B\n")
        (engine / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from halfmoon.engine import a\n")
        assert circles(all_imports((tmp_path,))) == [["halfmoon.engine.a", "halfmoon.engine.b", "halfmoon.engine.a"]]

    def test_the_library_never_imports_a_service(self):
        assert into_services(all_imports()) == []

    def test_a_library_import_of_a_service_is_caught(self, tmp_path):
        cli = tmp_path / "halfmoon" / "cli"
        cli.mkdir(parents=True)
        (cli / "bad.py").write_text("import halfmoon.services\nfrom halfmoon.services.gateway import auth\n")
        assert into_services(all_imports((tmp_path,))) == [
            "halfmoon.cli.bad:1 imports halfmoon.services", "halfmoon.cli.bad:2 imports halfmoon.services.gateway"]
        assert upward(all_imports((tmp_path,))) != []

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
