"""One distribution, one import name: ``halfmoon``, whose library lives in shared/halfmoon/ and whose
services live in services/halfmoon/services/ (the design card's top-level folders).

``build_kernels`` (a step of every build, ``pip install .`` and ``pip install -e .`` alike) compiles the
engine's C kernels once per ISA level of this machine (engine/kernel_build.py), next to their sources:
into the wheel, or in place for an editable install. Without a C compiler it says so and builds none;
the engine then compiles them on first use where it finds a compiler, else runs PyTorch's operators,
and reports which in its heartbeat, metrics and `halfmoon up`'s table.
"""

import importlib.util
import platform
import sys
from pathlib import Path
from typing import ClassVar

from setuptools import Command, find_namespace_packages, setup
from setuptools.command.build import build
from setuptools.dist import Distribution

ROOT = Path(__file__).parent
KERNELS = Path("shared", "halfmoon", "engine", "kernels")


def _kernel_build():
    """engine/kernel_build.py, loaded by path: the build must not import halfmoon (nor its dependencies)."""
    spec = importlib.util.spec_from_file_location("halfmoon_kernel_build", ROOT / KERNELS.parent / "kernel_build.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class BuildKernels(Command):
    """Every kernel for every ISA level of this machine, beside its source."""

    description = "compile the engine's C kernels for every ISA level of this machine"
    user_options: ClassVar[list[tuple[str, str, str]]] = []
    editable_mode = False

    def initialize_options(self) -> None:
        self.build_lib = None

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _folder(self) -> Path:
        return ROOT / KERNELS if self.editable_mode else Path(self.build_lib, *KERNELS.parts[1:])

    def run(self) -> None:
        kernel_build = _kernel_build()
        try:
            kernel_build.compiler()
        except RuntimeError as exc:
            self.announce(f"halfmoon: C kernels not prebuilt ({exc}); the engine compiles them on first use "
                          "where it finds a compiler, else runs PyTorch's operators", level=3)
            return
        for path in kernel_build.prebuild(self._folder()):
            self.announce(f"halfmoon: kernel {path}", level=2)

    def get_outputs(self) -> list[str]:
        kernel_build = _kernel_build()
        return [str(Path(self.build_lib, *KERNELS.parts[1:], kernel_build.library_name(source, level)))
                for level in kernel_build.levels_for(platform.machine()) for source in kernel_build.sources()]

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def get_source_files(self) -> list[str]:
        return [str(p.relative_to(ROOT)) for p in sorted((ROOT / KERNELS).glob("*.[ch]"))]


class BinaryDistribution(Distribution):
    """Platform wheels: they carry libraries compiled for this machine's architecture."""

    def has_ext_modules(self) -> bool:
        return True


build.sub_commands.append(("build_kernels", None))

setup(
    packages=find_namespace_packages("shared", include=["halfmoon", "halfmoon.*"])
    + find_namespace_packages("services", include=["halfmoon.services", "halfmoon.services.*"]),
    package_dir={"": "shared", "halfmoon.services": "services/halfmoon/services"},
    cmdclass={"build_kernels": BuildKernels},
    distclass=BinaryDistribution,
)
