"""Mooncake's transfer engine as a data-plane path (RDMA, NVLink or TCP, as the site runs it).

Optional: ``pip install halfmoon[mooncake]`` (``mooncake-transfer-engine-non-cuda``; its native
library needs Debian's ``libibverbs1``, ``libnl-3-200`` and ``libnl-route-3-200`` even for TCP).
A transfer node runs one engine, registers its DRAM segment with it once (``MooncakeSegment``)
and offers ``MooncakeOffer`` (engine session, segment address and size) to peers. A client runs
one engine per process and reaches the segment with ``OneSidedTransport(control,
MooncakePath(engine, offer))``: control messages still go over the node's TCP port, the bytes
through the engine's batched one-sided reads and writes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import msgspec

from halfmoon.transfer.chooser import Opener
from halfmoon.transfer.local_memory import LocalMemory, address_of
from halfmoon.transfer.onesided import OneSidedPath, OneSidedTransport
from halfmoon.transfer.rdma_plan import Copy, PostLimits, Region, plan_work_requests
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import TransferError

# one engine batch; larger transfers are split (the engine's batch has a fixed capacity)
BATCH = PostLimits(max_sge=1, max_wr=128, max_message=64 << 20, queue_depth=128)


class MooncakeUnavailable(RuntimeError):
    """The engine's wheel or its native libraries are missing; the message says which."""


def engine_class() -> type:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise MooncakeUnavailable(
            f"mooncake transfer engine not importable ({exc}); pip install 'halfmoon[mooncake]' and "
            "apt-get install libibverbs1 libnl-3-200 libnl-route-3-200"
        ) from None
    return TransferEngine


class MooncakeOffer(msgspec.Struct, frozen=True):
    session: str  # the node engine's "host:rpc_port"
    segment_addr: int
    segment_size: int


class MooncakeEngine:
    """One engine per process. ``protocol`` is ``tcp`` or ``rdma`` (then ``device`` names the
    NICs, e.g. ``mlx5_0``); peers find each other by session id (P2P handshake, no metadata
    server)."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> None:
        self.engine = engine_class()()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise MooncakeUnavailable(f"mooncake engine failed to start on {host} over {protocol} (rc {rc})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._lock = threading.Lock()

    def register(self, region: Region) -> int:
        with self._lock:
            rc = self.engine.register_memory(region.addr, region.length)
        if rc != 0:
            raise TransferError(f"mooncake: registering {region.length} bytes failed (rc {rc})")
        return region.addr

    def unregister(self, handle: int) -> None:
        with self._lock:
            self.engine.unregister_memory(handle)

    def transfer(self, session: str, write: bool, local: list[int], remote: list[int], lengths: list[int]) -> None:
        op = self.engine.batch_transfer_sync_write if write else self.engine.batch_transfer_sync_read
        rc = op(session, local, remote, lengths)
        if rc != 0:
            raise TransferError(f"mooncake {'write to' if write else 'read from'} {session} failed (rc {rc})")


class MooncakeSegment:
    """The node's side: its DRAM segment registered once with the node's engine."""

    def __init__(self, engine: MooncakeEngine, segment: memoryview) -> None:
        self.engine = engine
        self.region = Region(address_of(segment), segment.nbytes)
        self._handle = engine.register(self.region)
        self._segment = segment  # registered memory must outlive the registration

    def offer(self) -> MooncakeOffer:
        return MooncakeOffer(self.engine.session, self.region.addr, self.region.length)

    def close(self) -> None:
        self.engine.unregister(self._handle)


class MooncakePath(OneSidedPath):
    kind = "mooncake"

    def __init__(self, engine: MooncakeEngine, offer: MooncakeOffer) -> None:
        self.engine = engine
        self.offer = offer
        self.segment_size = offer.segment_size
        self.memory = LocalMemory(engine)

    def transfer(self, write: bool, copies: Sequence[Copy]) -> None:
        base = self.offer.segment_addr
        wrs = plan_work_requests((c._replace(remote=base + c.remote) for c in copies), BATCH)
        for i in range(0, len(wrs), BATCH.max_wr):
            batch = wrs[i : i + BATCH.max_wr]
            self.engine.transfer(self.offer.session, write, [w.sges[0].addr for w in batch],
                                 [w.remote for w in batch], [w.length for w in batch])

    def close(self) -> None:
        self.memory.close()


def mooncake_opener(engine: MooncakeEngine) -> Opener:
    """The chooser's opener for nodes that offer a Mooncake session."""

    async def open_(address: str, control: TcpTransport, info: dict) -> OneSidedTransport:
        offer = msgspec.convert(info, MooncakeOffer)
        return OneSidedTransport(control, MooncakePath(engine, offer))

    return Opener("mooncake", open_)
