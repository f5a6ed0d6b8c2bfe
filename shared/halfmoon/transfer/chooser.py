"""Per peer, the paths both ends have, fastest first: shared memory (same host), RDMA, Mooncake's
transfer engine, and TCP, which every node serves and which always comes last.

A node offers paths in its HELLO answer (``framing.Offers``: its RDMA device, its Mooncake
session) and this process has some (``Opener``s: an opened RDMA device, a running Mooncake
engine). ``path_kinds`` is the pure choice; ``TransferClient`` opens the paths it names.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from halfmoon.transfer.tcp import TcpTransport
    from halfmoon.transfer.transport import Transport

PREFERENCE = ("shm", "rdma", "mooncake", "tcp")


def path_kinds(local: set[str], offered: set[str], same_host: bool) -> list[str]:
    """Paths both ends have, in preference order; shared memory only on one host, TCP always."""
    usable = (local & offered) | {"tcp"}
    if same_host:
        usable.add("shm")
    return [k for k in PREFERENCE if k in usable]


class Opener(NamedTuple):
    """Opens one kind of path to a node: ``(address, control, connect info) -> transport``; the
    control connection is the path's own (closing the transport closes it)."""

    kind: str
    open: Callable[[str, TcpTransport, dict], Awaitable[Transport]]
