"""infra/Dockerfile: lint clean, every COPY source exists and reaches the build context, and the
image holds what compose and Kubernetes expect of it."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

from tests.conftest import REPO_ROOT
from tests.deploy.conftest import env_of, tool

DOCKERFILE = REPO_ROOT / "infra" / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / "infra" / "Dockerfile.dockerignore"


def instructions() -> list[tuple[str, list[str]]]:
    """(instruction, arguments) of each Dockerfile line, continuation lines joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split()[0].upper(), shlex.split(line)[1:]) for line in lines]


def copies() -> list[tuple[list[str], str]]:
    result = []
    for op, args in instructions():
        if op == "COPY" and not any(a.startswith("--from=") for a in args):  # --from: another stage, not the context
            paths = [a for a in args if not a.startswith("--")]
            result.append((paths[:-1], paths[-1]))
    return result


class TestDockerfileLint:
    def test_hadolint_is_clean(self) -> None:
        result = subprocess.run(
            [tool("hadolint"), str(DOCKERFILE)], check=False, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr


class TestCopySources:
    def test_every_source_exists(self) -> None:
        sources = [src for srcs, _ in copies() for src in srcs]
        assert sources
        for src in sources:
            assert (REPO_ROOT / src).exists(), f"COPY {src}: no such path in the build context"

    def test_every_source_is_in_the_build_context(self) -> None:
        kept = {line[1:].rstrip("/") for line in DOCKERIGNORE.read_text().splitlines() if line.startswith("!")}
        for srcs, _ in copies():
            for src in srcs:
                inside = [src.rstrip("/"), *(str(parent) for parent in Path(src).parents)]  # !shared/ keeps shared/a/b
                assert any(path in kept for path in inside), f"COPY {src} is excluded by {DOCKERIGNORE.name}"


class TestImageContents:
    def test_torch_pinned_before_the_project(self) -> None:
        runs = [" ".join(args) for op, args in instructions() if op == "RUN"]
        torch = next(i for i, r in enumerate(runs) if "torch==" in r)
        assert "torch==2.13.0" in runs[torch]
        assert torch < next(i for i, r in enumerate(runs) if "pip install -e ." in r)

    def test_entrypoint_is_copied_in(self) -> None:
        entrypoint = next(args for op, args in instructions() if op == "ENTRYPOINT")
        program = entrypoint[0].strip('[]",')
        assert any(dest == program or dest == "/usr/local/bin/" + program for _, dest in copies())

    def test_baked_model_is_the_default_everywhere(self, compose: dict[str, Any], k8s_base: list[dict]) -> None:
        run = next(
            " ".join(args) for op, args in instructions() if op == "RUN" and "halfmoon model tiny" in " ".join(args)
        )
        baked = run.split("halfmoon model tiny", 1)[1].split()[0]
        for name in ("prefill", "decode", "gateway"):
            assert env_of(compose["services"][name])["HALFMOON_MODEL_DIR"] == baked
        config = next(d for d in k8s_base if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "halfmoon-env")
        assert config["data"]["HALFMOON_MODEL_DIR"] == baked
        assert Path(baked).parent.as_posix() in {v.split(":")[1] for v in compose["services"]["prefill"]["volumes"]}
