"""Which data-plane paths a process uses (a worker) or offers (a transfer node), from its config.

TCP is always on. Shared memory is used between processes of one host. RDMA (our pyverbs queue
pairs) and Mooncake's transfer engine are opened only when ``data_paths`` names them, and a
process that cannot open one it was told to use fails at start, saying what is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from halfmoon.core.cluster_keys import ClusterKeys
from halfmoon.runtime.config import ServiceConfig, require_for, setting
from halfmoon.transfer.chooser import PREFERENCE, Opener
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.framing import NO_OFFERS, Offers
from halfmoon.transfer.server import Accept

if TYPE_CHECKING:
    from halfmoon.transfer.mooncake import MooncakeEngine
    from halfmoon.transfer.rdma import VerbsDevice


@dataclass(frozen=True)
class DataPlaneConfig(ServiceConfig):
    """Settings of the processes that move KV blocks: transfer nodes and workers."""

    data_paths: str = field(default="shm,tcp", metadata={
        "help": "data-plane paths, comma separated, of shm, rdma, mooncake, tcp (tcp is always on): a worker "
                "uses those a node offers too, fastest first; a transfer node offers rdma and mooncake"})
    data_host: str = field(default="", metadata={
        "help": "address peers reach this process's Mooncake endpoint at (default: a node's advertised "
                "host, a worker's 127.0.0.1)"})
    mooncake_protocol: str = field(default="tcp", metadata={"help": "Mooncake engine transport: tcp or rdma"})
    mooncake_device: str = field(default="", metadata={"help": "RDMA NICs of the Mooncake engine, e.g. mlx5_0"})
    rdma_device: str = field(default="", metadata={"help": "RDMA device of the rdma path (default: the first)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = set(self.paths) - set(PREFERENCE)
        if unknown:
            raise ValueError(f"data_paths: unknown path(s) {sorted(unknown)}; choose from {', '.join(PREFERENCE)}")
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake_protocol must be tcp or rdma, got {self.mooncake_protocol!r}")
        paths = f"{setting('data_paths')} naming"
        require_for(self, ["data_host", "mooncake_protocol", "mooncake_device"], "mooncake" in self.paths,
                    f"{paths} mooncake")
        require_for(self, ["mooncake_device"], self.mooncake_protocol == "rdma", f"{setting('mooncake_protocol')} rdma")
        require_for(self, ["rdma_device"], "rdma" in self.paths, f"{paths} rdma")

    @property
    def paths(self) -> frozenset[str]:
        return frozenset(p.strip() for p in self.data_paths.split(",") if p.strip()) | {"tcp"}


class NodeOffers(NamedTuple):
    """What a transfer node offers in HELLO, and its CONNECT answer (set exactly with an RDMA offer)."""

    offers: Offers
    accept: Accept | None


class OneSidedEndpoints:
    """This process's one-sided endpoints, each opened once (NOTE: one Mooncake engine per
    process): a Mooncake engine and an RDMA device where ``data_paths`` names them. ``host``
    is where peers reach them, unless the config's ``data_host`` says otherwise."""

    def __init__(self, config: DataPlaneConfig, host: str = "127.0.0.1") -> None:
        self.config = config
        self.mooncake: MooncakeEngine | None = None
        self.rdma: VerbsDevice | None = None
        self._closers: list[Callable[[], None]] = []
        if "mooncake" in config.paths:
            from halfmoon.transfer.mooncake import MooncakeEngine

            self.mooncake = MooncakeEngine(config.data_host or host, config.mooncake_protocol, config.mooncake_device)
        if "rdma" in config.paths:
            from halfmoon.transfer.rdma import VerbsDevice

            self.rdma = VerbsDevice(config.rdma_device or None)
            self._closers.append(self.rdma.close)

    def client(self, keys: ClusterKeys, same_host: bool = True) -> TransferClient:
        """A client using every path configured: shared memory (where ``same_host`` allows), then these."""
        openers: list[Opener] = []
        if self.mooncake is not None:
            from halfmoon.transfer.mooncake import mooncake_opener

            openers.append(mooncake_opener(self.mooncake))
        if self.rdma is not None:
            from halfmoon.transfer.rdma import exchange_over_control, rdma_opener

            openers.append(rdma_opener(self.rdma, exchange_over_control))
        return TransferClient(same_host=same_host and "shm" in self.config.paths, keys=keys, openers=openers)

    def offer(self, segment: memoryview) -> NodeOffers:
        """Register a node's DRAM segment with each endpoint, once; what HELLO then offers."""
        offers, accept = NO_OFFERS, None
        if self.mooncake is not None:
            from halfmoon.transfer.mooncake import MooncakeSegment

            exported = MooncakeSegment(self.mooncake, segment)
            offers = msgspec.structs.replace(offers, mooncake=msgspec.to_builtins(exported.offer()))
            self._closers.insert(0, exported.close)
        if self.rdma is not None:
            from halfmoon.transfer.rdma import VerbsSegment

            registered = VerbsSegment(self.rdma, segment)
            offers = msgspec.structs.replace(offers, rdma={"device": self.rdma.name})
            accept = registered.accept_wire
            self._closers.insert(0, registered.close)
        return NodeOffers(offers, accept)

    def close(self) -> None:
        """Registrations first, then the devices."""
        for closer in self._closers:
            closer()
        self._closers.clear()
