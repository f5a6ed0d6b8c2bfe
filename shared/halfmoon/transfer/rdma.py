"""RDMA transport with pyverbs: RC queue pairs, the node's DRAM segment registered once, one-sided
READ/WRITE in batched posts, completions by polling.

This is the thin layer over the device; what it executes is planned in ``rdma_plan`` (which
is tested without a device). A node registers its segment once (``VerbsSegment``) and gives
each client a queue pair of its own; the two ends swap ``RdmaEndpoint``s over the node's
control connection and move their queue pairs to RTS. The client then reads and writes the
segment with ``OneSidedTransport(control, VerbsPath(...))``.

pyverbs ships with rdma-core (Debian: ``python3-pyverbs``), built for the system Python; a
virtual environment of the same Python version can import it from the system's
dist-packages, which ``import_pyverbs`` falls back to.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from types import ModuleType
from typing import Any, Protocol

import msgspec

from halfmoon.transfer.chooser import Opener
from halfmoon.transfer.framing import Op, Request
from halfmoon.transfer.local_memory import LocalMemory
from halfmoon.transfer.onesided import OneSidedPath, OneSidedTransport
from halfmoon.transfer.rdma_plan import (
    Completions,
    Copy,
    PostLimits,
    Region,
    plan_posts,
)
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import TransferError

SYSTEM_DIST = os.environ.get("HALFMOON_PYVERBS_PATH", "/usr/lib/python3/dist-packages")
POLL_BATCH = 32


class VerbsObject(Protocol):
    """A pyverbs resource: freed by ``close()``."""

    def close(self) -> None: ...


class MemoryRegion(VerbsObject, Protocol):
    """pyverbs' ``MR``."""

    lkey: int
    rkey: int


class QueuePair(VerbsObject, Protocol):
    """pyverbs' ``QP``; the attributes and work requests are pyverbs' own objects."""

    qp_num: int

    def to_rts(self, attr: Any) -> None: ...

    def post_send(self, wr: Any) -> None: ...


class CompletionQueue(VerbsObject, Protocol):
    """pyverbs' ``CQ``: ``poll`` returns how many completions it took and the work completions."""

    def poll(self, num_entries: int) -> tuple[int, list[Any]]: ...


class RdmaUnavailable(RuntimeError):
    """pyverbs or an RDMA device is missing; the message says which."""


def import_pyverbs() -> ModuleType:
    try:
        return importlib.import_module("pyverbs")
    except ImportError:
        if SYSTEM_DIST in sys.path or not os.path.isdir(os.path.join(SYSTEM_DIST, "pyverbs")):
            raise RdmaUnavailable("pyverbs is not installed (Debian: apt-get install python3-pyverbs)") from None
    sys.path.append(SYSTEM_DIST)  # appended: the venv's own packages keep precedence
    try:
        return importlib.import_module("pyverbs")
    except ImportError as exc:
        raise RdmaUnavailable(f"pyverbs in {SYSTEM_DIST} does not import here: {exc}") from None


def rdma_devices() -> list[str]:
    """Names of the RDMA devices; raises ``RdmaUnavailable`` without pyverbs or devices."""
    import_pyverbs()
    from pyverbs.device import get_device_list
    from pyverbs.pyverbs_error import PyverbsError

    try:
        names = [d.name.decode() for d in get_device_list()]
    except PyverbsError as exc:  # no /sys/class/infiniband at all
        raise RdmaUnavailable(f"no RDMA device: {exc}") from None
    if not names:
        raise RdmaUnavailable("no RDMA device")
    return names


class RdmaEndpoint(msgspec.Struct, frozen=True):
    """What one end of an RC connection tells the other (plus, from a node, its segment)."""

    qpn: int
    psn: int
    lid: int
    gid: str  # hex; empty on InfiniBand without a global route
    mtu: int
    segment_addr: int = 0
    segment_rkey: int = 0
    segment_size: int = 0


class VerbsDevice:
    """One opened device port: context, protection domain, registrations; queue pairs on demand."""

    def __init__(self, name: str | None = None, port: int = 1, gid_index: int = 0) -> None:
        import_pyverbs()
        from pyverbs.device import Context
        from pyverbs.pd import PD

        self.name = name or rdma_devices()[0]
        self.port, self.gid_index = port, gid_index
        self.ctx = Context(name=self.name)
        self.pd = PD(self.ctx)
        attr = self.ctx.query_port(port)
        self.lid, self.mtu = attr.lid, attr.active_mtu
        self.gid = str(self.ctx.query_gid(port, gid_index))
        dev = self.ctx.query_device()
        self.limits = PostLimits(max_sge=min(16, dev.max_sge), max_wr=64, max_message=min(1 << 30, attr.max_msg_sz),
                                 queue_depth=min(256, dev.max_qp_wr))

    def register(self, region: Region, remote: bool = False) -> MemoryRegion:
        import pyverbs.enums as e
        from pyverbs.mr import MR

        access = e.IBV_ACCESS_LOCAL_WRITE
        if remote:
            access |= e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        return MR(self.pd, region.length, access, address=region.addr)

    def unregister(self, handle: MemoryRegion) -> None:
        handle.close()

    def queue_pair(self) -> tuple[QueuePair, CompletionQueue, RdmaEndpoint]:
        """An RC queue pair with a completion queue of its own (so no path polls another's)."""
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPCap, QPInitAttr

        cap = QPCap(max_send_wr=self.limits.queue_depth, max_recv_wr=1, max_send_sge=self.limits.max_sge,
                    max_recv_sge=1)
        cq = CQ(self.ctx, self.limits.queue_depth + 1)
        qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0))
        psn = int.from_bytes(os.urandom(3), "little")
        return qp, cq, RdmaEndpoint(qp.qp_num, psn, self.lid, self.gid, int(self.mtu))

    def connect(self, qp: QueuePair, local: RdmaEndpoint, peer: RdmaEndpoint) -> None:
        """RESET -> INIT -> RTR -> RTS towards the peer's queue pair."""
        import pyverbs.enums as e
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET, port_num=self.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        attr.path_mtu = min(local.mtu, peer.mtu)
        attr.dest_qp_num, attr.rq_psn, attr.sq_psn = peer.qpn, peer.psn, local.psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 16
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        gr = GlobalRoute(dgid=GID(peer.gid), sgid_index=self.gid_index) if peer.gid else None
        attr.ah_attr = AHAttr(port_num=self.port, dlid=peer.lid, is_global=int(gr is not None), gr=gr)
        qp.to_rts(attr)

    def close(self) -> None:
        for obj in (self.pd, self.ctx):
            obj.close()


class VerbsSegment:
    """The node's side: its DRAM segment registered once for remote READ/WRITE; one QP per client."""

    def __init__(self, device: VerbsDevice, segment: memoryview) -> None:
        from halfmoon.transfer.local_memory import address_of

        self.device = device
        self.region = Region(address_of(segment), segment.nbytes)
        self.mr = device.register(self.region, remote=True)
        self._qps: list[VerbsObject] = []

    def accept(self, client: RdmaEndpoint) -> RdmaEndpoint:
        qp, cq, local = self.device.queue_pair()
        self.device.connect(qp, local, client)
        self._qps += [qp, cq]
        rkey = self.mr.rkey
        return msgspec.structs.replace(local, segment_addr=self.region.addr, segment_rkey=rkey,
                                       segment_size=self.region.length)

    def accept_wire(self, client: bytes) -> bytes:
        """``accept`` for the block server's CONNECT: msgpack endpoints in and out."""
        try:
            endpoint = msgspec.msgpack.decode(client, type=RdmaEndpoint)
        except msgspec.DecodeError as exc:
            raise ValueError(f"not an RDMA endpoint: {exc}") from None
        return msgspec.msgpack.encode(self.accept(endpoint))

    def close(self) -> None:
        for obj in self._qps:
            obj.close()
        self.mr.close()


class VerbsPath(OneSidedPath):
    """A client's RC queue pair to one node, executing ``plan_posts`` and polling completions."""

    kind = "rdma"

    def __init__(
        self, device: VerbsDevice, qp: QueuePair, cq: CompletionQueue, node: RdmaEndpoint, timeout_s: float = 30.0
    ) -> None:
        self.device, self.qp, self.cq, self.node = device, qp, cq, node
        self.segment_size = node.segment_size
        self.memory = LocalMemory(device)
        self.timeout_s = timeout_s

    def transfer(self, write: bool, copies: Sequence[Copy]) -> None:
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        opcode = e.IBV_WR_RDMA_WRITE if write else e.IBV_WR_RDMA_READ
        limits = self.device.limits
        done = Completions(limits.queue_depth)
        deadline = time.monotonic() + self.timeout_s
        remote = [c._replace(remote=self.node.segment_addr + c.remote) for c in copies]
        for post in plan_posts(remote, limits):
            while (ids := done.reserve(post)) is None:
                self._poll(done, deadline)
            chain: SendWR | None = None
            keep = []  # NOTE: a chained SendWR points into the next one's memory: keep them all alive
            for wr_id, wr in reversed(list(zip(ids, post.wrs))):
                sges = [SGE(s.addr, s.length, self.memory.registrations.handle(s.addr, s.length).lkey) for s in wr.sges]
                flags = e.IBV_SEND_SIGNALED if chain is None else 0
                chain = SendWR(wr_id=wr_id, opcode=opcode, num_sge=len(sges), sg=sges, send_flags=flags, next_wr=chain)
                chain.set_wr_rdma(self.node.segment_rkey, wr.remote)
                keep.append(chain)
            self.qp.post_send(chain)
        while not done.done:
            self._poll(done, deadline)
        try:
            done.raise_if_failed()
        except Exception as exc:
            raise TransferError(f"rdma {self.device.name}: {exc}") from exc

    def _poll(self, done: Completions, deadline: float) -> None:
        import pyverbs.enums as e

        n, wcs = self.cq.poll(POLL_BATCH)
        for wc in wcs[:n]:
            done.complete(wc.wr_id, wc.status == e.IBV_WC_SUCCESS, f"status {wc.status}")
        if n == 0 and time.monotonic() > deadline:
            raise TransferError(f"rdma {self.device.name}: no completion within {self.timeout_s} s")
        if done.errors:
            raise TransferError(f"rdma {self.device.name}: {'; '.join(done.errors)}")

    def close(self) -> None:
        self.memory.close()
        self.qp.close()
        self.cq.close()


Exchange = Callable[[TcpTransport, RdmaEndpoint], Awaitable[RdmaEndpoint]]


async def exchange_over_control(control: TcpTransport, local: RdmaEndpoint) -> RdmaEndpoint:
    """The client's half of CONNECT: send our endpoint over the node's control connection, get its."""
    answer = await control.request(Request(Op.CONNECT, endpoint=msgspec.msgpack.encode(local)))
    if not answer.ok:
        raise TransferError(f"{control.address}: {answer.error}")
    try:
        return msgspec.msgpack.decode(answer.endpoint, type=RdmaEndpoint)
    except msgspec.DecodeError as exc:
        raise TransferError(f"{control.address}: bad RDMA endpoint in CONNECT answer: {exc}") from None


def rdma_opener(device: VerbsDevice, exchange: Exchange) -> Opener:
    """The chooser's opener for nodes that offer RDMA. ``exchange`` sends this end's endpoint over
    the node's control connection and returns the node's (its ``VerbsSegment.accept`` answer):
    ``exchange_over_control``, the CONNECT op."""

    async def open_(address: str, control: TcpTransport, info: dict) -> OneSidedTransport:
        qp, cq, local = device.queue_pair()
        try:
            node = await exchange(control, local)
            device.connect(qp, local, node)
        except BaseException:
            qp.close()
            cq.close()
            raise
        return OneSidedTransport(control, VerbsPath(device, qp, cq, node))

    return Opener("rdma", open_)
