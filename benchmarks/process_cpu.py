"""Where a server's CPU time goes while a load runs: CPU seconds by process, for a process tree and for
the load generator.

On a machine of few cores every process beside the engine takes its compute from the engine: a server
that serves fewer tokens/s than a peer with the same engine shows here which of its processes took the
difference. ``CpuMeter(pids)`` reads the trees' CPU times (user + system) on entry and on exit; processes
are labelled by what they run (``python -m halfmoon.services.gateway`` is ``gateway``; a child vLLM spawns
is labelled by its process title, e.g. ``VLLM::EngineCore``), and the load generator, a child this process
waits for, by its own resource usage.
"""

from __future__ import annotations

import resource
from collections import defaultdict
from collections.abc import Sequence

import psutil

LOAD_GENERATOR = "load generator"


def label(process: psutil.Process) -> str:
    """What a process is, in a word: the module it runs, else its name (a process title where one is set)."""
    try:
        cmdline = process.cmdline()
        if "-m" in cmdline[:-1]:
            module = cmdline[cmdline.index("-m") + 1]
            return module.removeprefix("halfmoon.services.").removeprefix("vllm.entrypoints.openai.")
        return process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"


def _tree_times(pids: Sequence[int]) -> dict[int, tuple[str, float]]:
    processes = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            processes += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    times = {}
    for process in processes:
        try:
            cpu = process.cpu_times()
            times[process.pid] = (label(process), cpu.user + cpu.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return times


def _children_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class CpuMeter:
    """CPU seconds by label of the trees under ``pids`` between entry and exit, plus this process's waited
    children (the load generator). A process that exits inside the block is not counted."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.seconds: dict[str, float] = {}

    def __enter__(self) -> CpuMeter:
        self._before = _tree_times(self.pids)
        self._children = _children_s()
        return self

    def __exit__(self, *exc: object) -> None:
        seconds: dict[str, float] = defaultdict(float)
        for pid, (name, spent) in _tree_times(self.pids).items():
            seconds[name] += spent - self._before.get(pid, (name, 0.0))[1]
        seconds[LOAD_GENERATOR] += _children_s() - self._children
        self.seconds = {name: round(spent, 2) for name, spent in sorted(seconds.items(), key=lambda kv: -kv[1])}
