"""The engine's C kernels (``engine/kernels/*.c``): built on first use for this CPU, cached, loaded.

Each is built with the system's C compiler (``$CC``, else ``cc``) with ``-march=native`` and OpenMP,
and cached under ``$HALFMOON_KERNEL_DIR`` (default ``~/.cache/halfmoon/kernels``), keyed by its
source, flags, compiler and CPU. The kernels run on the OpenMP runtime torch has already loaded
(libgomp.so.1), so torch and they share one thread pool. Without a compiler, when a build fails,
or when its switch variable is ``0``, a kernel is None and its caller keeps to PyTorch (logged once).
``python -m halfmoon.engine.native`` builds them all ahead and prints where they are.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

KERNELS = Path(__file__).with_name("kernels")
# fast-math without finite-math-only: the kernels start running maxima at -FLT_MAX, never rely on inf
# 512-bit vectors where the CPU has them: a quarter less time for the layer ops than gcc's default of 256
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-fopenmp", "-shared", "-fPIC")
log = logging.getLogger(__name__)


def switched_off(variable: str) -> bool:
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")


@cache
def library(name: str, switch: str) -> ctypes.CDLL | None:
    """``kernels/<name>.c`` loaded, built if needed; None when ``$<switch>`` is 0 or it cannot be built."""
    if switched_off(switch):
        return None
    try:
        return ctypes.CDLL(str(built(KERNELS / f"{name}.c")))
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("C kernel %s unavailable, using PyTorch: %s", name, exc)
        return None


def built(source: Path) -> Path:
    """The shared library of ``source`` in the kernel cache, compiled first when it is not there."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    headers = b"".join(header.read_bytes() for header in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + repr(FLAGS).encode() + version.encode()
                         + _cpu().encode()).hexdigest()
    folder = Path(os.environ.get("HALFMOON_KERNEL_DIR") or Path.home() / ".cache" / "halfmoon" / "kernels")
    target = folder / f"{source.stem}-{key[:16]}.so"
    if target.exists():
        return _trusted(target)
    folder.mkdir(parents=True, exist_ok=True)
    _trusted(folder)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # NOTE: built aside, then renamed: concurrent builds agree
        out = Path(tmp) / target.name
        result = subprocess.run([compiler, *FLAGS, "-o", str(out), str(source), "-lm"], check=False, capture_output=True,
                                text=True, timeout=300)
        if result.returncode:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(out, target)
    return target


def _trusted(path: Path) -> Path:
    """``path`` (and, for a library, its folder), unless any user could have put or changed it there: a
    library loaded from the cache runs as this process. (Group-writable passes: with per-user groups, the
    usual umask 002, the group is the owner alone.)"""
    for item in (path, path.parent) if path.is_file() else (path,):
        info = item.stat()
        if info.st_mode & 0o002 or info.st_uid not in (os.getuid(), 0):
            raise RuntimeError(f"{item} is writable by other users or owned by another: not loading kernels from it")
    return path


def build_all() -> list[Path]:
    """Every kernel in the cache, built where missing: what an image or a shared directory can hold ahead."""
    return [built(source) for source in sorted(KERNELS.glob("*.c"))]


def _cpu() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        import platform

        return platform.processor()


if __name__ == "__main__":
    for path in build_all():
        print(path)
