"""The real `docker compose` stack, end to end: infra/compose-check.sh, which starts a Docker engine
when none runs (installing docker.io, docker-compose and debootstrap with apt-get as root if missing),
builds every image with no container registry, brings the stack up with 2 prefill, 2 decode and 2
gateway replicas and checks serving, metrics, traces, healing and `down -v` (docs/DEPLOY.md).

Skipped, with the script's reason, only where no engine can be had (not root and none running, no
apt-get, dockerd refusing to start). HALFMOON_COMPOSE_CHECK=0 leaves it out on purpose (a developer's
quick run); HALFMOON_COMPOSE_CHECK_ARGS passes options to the script (e.g. `--skip nats-loss`).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "infra" / "compose-check.sh"
SKIP = 77


class TestComposeStack:
    @pytest.mark.timeout(3600)
    def test_serves_through_nginx_heals_and_leaves_nothing(self, tmp_path: Path) -> None:
        if os.environ.get("HALFMOON_COMPOSE_CHECK", "1") == "0":
            pytest.skip("HALFMOON_COMPOSE_CHECK=0")
        log = tmp_path / "compose-check.log"
        args = shlex.split(os.environ.get("HALFMOON_COMPOSE_CHECK_ARGS", ""))
        start = time.monotonic()
        with log.open("w") as out:
            proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                  check=False, timeout=3500)
        lines = log.read_text().strip().splitlines()
        last = lines[-1] if lines else "(no output)"
        print(f"compose check: {time.monotonic() - start:.0f} s; {last}")
        if proc.returncode == SKIP:
            pytest.skip(last)
        assert proc.returncode == 0, "\n".join(lines[-60:])
        assert last.startswith("compose-check: PASS"), last
