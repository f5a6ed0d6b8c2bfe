"""The engine's C kernels (``engine/kernels/*.c``) loaded for this CPU's ISA level, and what an engine reports
about them.

Each kernel has one library per ISA level (engine/kernel_build.py). The level is chosen from the CPU's
flags, highest first. The library is looked for beside the sources, where ``pip install`` (and the
image's build stage) put them prebuilt; a library whose name does not match the sources (they changed
since) is not one of them. Only where none is there is it compiled, as a fallback, with ``$CC`` (else
``cc``) into ``$HALFMOON_KERNEL_DIR`` (default ``~/.cache/halfmoon/kernels``), keyed by source, flags and
compiler. The kernels run on the OpenMP runtime torch has already loaded (libgomp.so.1), so torch and
they share one thread pool. Without a library and a compiler, when a build fails, or when its switch
variable is ``0``, a kernel is None and its caller keeps to PyTorch; ``report`` says which and why.
``python -m halfmoon.engine.native`` loads them and prints where from.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from halfmoon.engine import kernel_build
from halfmoon.engine.kernel_build import KERNELS, Level
from halfmoon.protocol.registry import KernelReport

if TYPE_CHECKING:
    import torch

# each kernel and the variable that switches it off
SWITCHES = {"decode_attention": "HALFMOON_DECODE_KERNEL", "decode_layers": "HALFMOON_DECODE_LAYERS_KERNEL",
            "layer_ops": "HALFMOON_LAYER_OPS_KERNEL",
            "linear": "HALFMOON_LINEAR_KERNEL", "prefill_attention": "HALFMOON_PREFILL_KERNEL",
            "sampling": "HALFMOON_SAMPLING_KERNEL"}
log = logging.getLogger(__name__)


class Loaded(NamedTuple):
    """One kernel's library for ``level``, and the file it came from; or None, and ``reason``."""

    library: ctypes.CDLL | None
    level: Level
    path: Path | None = None
    reason: str = ""


def pointer(tensor: torch.Tensor | None) -> ctypes.c_void_p:
    """A tensor's data as a kernel's pointer argument; NULL for None."""
    return ctypes.c_void_p(tensor.data_ptr() if tensor is not None else None)


def switched_off(variable: str) -> bool:
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")


def library(name: str) -> ctypes.CDLL | None:
    """``kernels/<name>.c``'s library for this CPU; None when it is switched off or cannot be had."""
    return loaded(name).library


@cache
def loaded(name: str) -> Loaded:
    """``kernels/<name>.c`` for this CPU's level: prebuilt, else built into the cache (logged once either way
    it fails)."""
    level = kernel_build.this_cpu()
    if switched_off(SWITCHES[name]):
        return Loaded(None, level, reason=f"switched off ({SWITCHES[name]}=0)")
    source = KERNELS / f"{name}.c"
    try:
        path = prebuilt(source, level) or built(source, level)
        return Loaded(ctypes.CDLL(str(path)), level, path)
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("C kernel %s unavailable, using PyTorch: %s", name, exc)
        return Loaded(None, level, reason=f"no prebuilt {level.name} library, and {exc}")


def prebuilt(source: Path, level: Level) -> Path | None:
    """The library installed beside ``source`` for ``level``, if it is there (and safe to load)."""
    path = source.with_name(kernel_build.library_name(source, level))
    return _trusted(path) if path.exists() else None


def built(source: Path, level: Level) -> Path:
    """The library of ``source`` for ``level`` in the kernel cache, compiled first when it is not there."""
    cc = kernel_build.compiler()
    folder = Path(os.environ.get("HALFMOON_KERNEL_DIR") or Path.home() / ".cache" / "halfmoon" / "kernels")
    target = folder / kernel_build.library_name(source, level, kernel_build.compiler_version(cc))
    if target.exists():
        return _trusted(target)
    folder.mkdir(parents=True, exist_ok=True)
    _trusted(folder)
    log.info("no prebuilt %s library for %s; compiling it into %s", level.name, source.name, folder)
    return kernel_build.compile_into(source, level, target, cc)


def _trusted(path: Path) -> Path:
    """``path`` (and, for a library, its folder), unless any user could have put or changed it there: a
    library loaded runs as this process. (Group-writable passes: with per-user groups, the usual umask
    002, the group is the owner alone.)"""
    for item in (path, path.parent) if path.is_file() else (path,):
        info = item.stat()
        if info.st_mode & 0o002 or info.st_uid not in (os.getuid(), 0):
            raise RuntimeError(f"{item} is writable by other users or owned by another: not loading kernels from it")
    return path


def build_all() -> list[Path]:
    """Every kernel in the cache for this CPU's level, built where missing."""
    level = kernel_build.this_cpu()
    return [built(source, level) for source in kernel_build.sources()]


def report(device_type: str) -> KernelReport:
    """What an engine on ``device_type`` runs: the C kernels (``native``, their level; ``reason`` names any
    that is not loaded) or PyTorch alone (``fallback``, and why)."""
    if device_type != "cpu":
        return KernelReport(kind="fallback", reason=f"{device_type} engine: the C kernels are for CPUs")
    kernels = [loaded(name) for name in SWITCHES]
    absent = {name: k.reason for name, k in zip(SWITCHES, kernels, strict=True) if k.library is None}
    if len(absent) == len(kernels):
        reasons = set(absent.values())
        return KernelReport(kind="fallback", reason=reasons.pop() if len(reasons) == 1 else
                            "; ".join(f"{name}: {why}" for name, why in absent.items()))
    return KernelReport(kind="native", isa=kernels[0].level.name,
                        reason="; ".join(f"{name}: {why}" for name, why in absent.items()))


if __name__ == "__main__":
    import torch

    print(f"kernels: {report('cpu')}")
    for kernel_name in SWITCHES:
        print(f"{kernel_name}: {loaded(kernel_name).path or loaded(kernel_name).reason}")
