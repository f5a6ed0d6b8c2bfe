"""A local process's resident memory as the kernel counts it, next to the bound its service reported."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

MIB = 1 << 20


class ProcessMemory(NamedTuple):
    """Bytes: ``rss`` counts every page mapped and touched, shared ones in full (a transfer segment in each
    process that maps it); ``pss`` divides each shared page among its mappers (the sum over processes is
    the machine's use); ``private`` is what only this process holds; ``shmem`` the shared-memory part of RSS."""

    rss: int
    pss: int
    private: int
    shmem: int


def process_memory(pid: int) -> ProcessMemory | None:
    """From ``/proc/PID/smaps_rollup``; None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    kib = {}
    for line in (text + status).splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if len(fields) == 2 and fields[1] == "kB":
            kib[name] = int(fields[0]) * 1024
    return ProcessMemory(rss=kib["Rss"], pss=kib["Pss"], private=kib["Private_Clean"] + kib["Private_Dirty"],
                         shmem=kib.get("RssShmem", 0))
