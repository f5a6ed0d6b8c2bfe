"""The engine's C kernels (``engine/kernels/*.c``) per ISA level: which levels there are, which one a CPU
runs, how each is compiled and what its library is called.

One library per level, not ``-march=native``: a library built on one machine runs on every CPU with its
level's flags (CI and containers move between AVX2-only EPYCs and AVX-512 Xeons). On x86-64 the levels
are ``avx512bf16`` (x86-64-v4 with AVX512-BF16: AMX Xeons, Zen 4 and later EPYCs), ``avx512`` (x86-64-v4),
``avx2`` (x86-64-v3, with FMA) and ``sse2`` (x86-64, every such CPU); other machines get one ``generic``
build for their compiler's default target. ``avx512bf16`` differs from ``avx512`` only where a kernel asks
for it (``__AVX512BF16__``: the prefill attention's and the projections' bfloat16 dot products). AMX is not
a level: no kernel here has matrix tiles to give it.

Standard library only: ``setup.py`` loads this file by path to prebuild the libraries at install time, and
the image's build stage runs it as a script (``python kernel_build.py``) with nothing else installed.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

KERNELS = Path(__file__).with_name("kernels")
# fast-math without finite-math-only: the kernels start running maxima at -FLT_MAX, never rely on inf
COMMON_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
                "-fopenmp", "-shared", "-fPIC")
X86_V2 = ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")
X86_V3 = (*X86_V2, "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
X86_V4 = (*X86_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


@dataclass(frozen=True)
class Level:
    """An ISA level: the CPU flags (``/proc/cpuinfo`` names) a CPU needs to run it, and its compiler flags."""

    name: str
    cpu_flags: tuple[str, ...]
    compiler_flags: tuple[str, ...]


X86_LEVELS = (  # highest first
    Level("avx512bf16", (*X86_V4, "avx512_bf16"),
          ("-march=x86-64-v4", "-mavx512bf16", "-mtune=generic", "-mprefer-vector-width=512")),
    # 512-bit vectors: a quarter less time for the layer ops than gcc's default of 256 at this level
    Level("avx512", X86_V4, ("-march=x86-64-v4", "-mtune=generic", "-mprefer-vector-width=512")),
    Level("avx2", X86_V3, ("-march=x86-64-v3", "-mtune=generic")),
    Level("sse2", (), ("-march=x86-64", "-mtune=generic")),
)
GENERIC = Level("generic", (), ())


def levels_for(machine: str) -> tuple[Level, ...]:
    """Every level built for ``machine`` (``platform.machine()``), highest first."""
    return X86_LEVELS if machine.lower() in ("x86_64", "amd64") else (GENERIC,)


def choose(machine: str, cpu_flags: frozenset[str]) -> Level:
    """The highest level of ``machine`` whose flags are all in ``cpu_flags``."""
    return next(level for level in levels_for(machine) if frozenset(level.cpu_flags) <= cpu_flags)


def this_cpu() -> Level:
    """The level this process's CPU runs (its flags as the kernel reports them, so as the OS enables them)."""
    return choose(platform.machine(), cpu_flags())


def cpu_flags() -> frozenset[str]:
    """This CPU's flags from ``/proc/cpuinfo``; empty where there is none (the lowest level then)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def sources() -> list[Path]:
    return sorted(KERNELS.glob("*.c"))


def flags_of(level: Level) -> tuple[str, ...]:
    return (*COMMON_FLAGS, *level.compiler_flags)


def library_name(source: Path, level: Level, *extra: str) -> str:
    """``<kernel>-<level>-<digest>.so``: the digest covers the source, the headers, the flags and ``extra``
    (a compiler's version), so a library built from other sources is never taken for this one."""
    headers = b"".join(header.read_bytes() for header in sorted(source.parent.glob("*.h")))
    digest = hashlib.sha256(b"\0".join([source.read_bytes(), headers, repr(flags_of(level)).encode(),
                                        *(e.encode() for e in extra)])).hexdigest()
    return f"{source.stem}-{level.name}-{digest[:16]}.so"


def compiler() -> str:
    """The C compiler (``$CC``, else ``cc``); RuntimeError where there is none."""
    found = shutil.which(os.environ.get("CC", "cc"))
    if found is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    return found


def compiler_version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout


def compile_into(source: Path, level: Level, target: Path, cc: str) -> Path:
    """``source`` compiled for ``level`` to ``target``, built aside and renamed so that concurrent builds
    of the same library agree; RuntimeError with the compiler's message when it fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        result = subprocess.run([cc, *flags_of(level), "-o", str(out), str(source), "-lm"], check=False,
                                capture_output=True, text=True, timeout=300)
        if result.returncode:
            raise RuntimeError(f"{cc} failed for {source.name} ({level.name}): {result.stderr.strip()[-500:]}")
        os.replace(out, target)
    return target


def prebuild(folder: Path, machine: str | None = None) -> list[Path]:
    """Every kernel for every level of ``machine`` (default: this one) in ``folder``, under the names the
    engine looks for beside the sources; those already there are kept."""
    cc, built = compiler(), []
    for level in levels_for(machine or platform.machine()):
        for source in sources():
            target = folder / library_name(source, level)
            built.append(target if target.exists() else compile_into(source, level, target, cc))
    return built


if __name__ == "__main__":  # python kernel_build.py: what an image's build stage runs, with no halfmoon installed
    for path in prebuild(KERNELS):
        print(path)
