"""A child that another virtual environment's interpreter runs (vLLM's, for `halfmoon up --engine-python`)
finds every service module of the launcher's checkout from ``SOURCE_ROOTS`` alone: the editable install of
the README reaches ``services/`` through a path hook of its own, which no other interpreter has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from halfmoon.deploy.topology import OPTIONAL_SERVICES, SERVICES


def test_another_interpreter_finds_every_service_module_from_the_source_roots(tmp_path: Path) -> None:
    # the launcher as a user runs it: outside the checkout, without pytest's pythonpath, which lists both folders
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = subprocess.run([sys.executable, "-c", "import json; from halfmoon.deploy.processes import SOURCE_ROOTS; "
                            "print(json.dumps(SOURCE_ROOTS))"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    roots = json.loads(found.stdout)
    modules = [spec.module for spec in (*SERVICES, *OPTIONAL_SERVICES)]
    # another interpreter: this one without its site-packages (-S), so without the editable install's hook
    probe = ("import importlib.util, json, sys; "
             f"print(json.dumps([m for m in {modules!r} if importlib.util.find_spec(m) is None]))")
    missing = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path,
                             env={**env, "PYTHONPATH": os.pathsep.join(roots)}, capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 0, missing.stderr
    assert json.loads(missing.stdout) == [], f"not found from {roots}"
