"""A worker's side of the pool protocol: look up a prefix, fetch its blocks, store new ones.

Blocks move straight between this process and the transfer nodes; only keys, locations and
leases go through the cache-manager. Everything here degrades to a miss: an unreachable
cache-manager or node, a missing or corrupt block all mean "recompute", never an error.
Every block is sealed under its key as it is written and verified under its key as it is
read (core/block_format.py); every node operation carries the capability the cache-manager
granted for that block (its answers' ``BlockLocation.capability``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar

from halfmoon.core.block_format import BlockLayout, Sealer, Verifier
from halfmoon.core.tiers import Tier
from halfmoon.protocol import codecs
from halfmoon.protocol.base import Codec, ErrorReply, Message, ProtocolError, RemoteError
from halfmoon.protocol.cache import CorruptBlocks, Lookup, LookupResult, PutEnd, PutPlan, PutStart, Release
from halfmoon.protocol.pool import RemoveRequest
from halfmoon.protocol.subjects import Subjects
from halfmoon.protocol.work import BlockLocation
from halfmoon.storage.allocator import Extent
from halfmoon.storage.base import Buffer, StorageError
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.framing import MISSING
from halfmoon.transfer.transport import BlockHook, TransferError

if TYPE_CHECKING:  # NOTE: only workers hold engines; the pool protocol itself needs no torch
    from halfmoon.engine.interface import LayerSource

CACHE_TIMEOUT_S = 2.0
FAILURES = (RemoteError, ProtocolError, TransferError, StorageError, OSError)
Rep = TypeVar("Rep")


class PoolPeer(Protocol):
    """Who talks to the cache-manager: a service, or a KV connector inside another engine (connectors/)."""

    instance_id: str
    log: logging.Logger
    subjects: Subjects

    async def request(self, subject: str, message: Message, reply_codec: Codec[Rep | ErrorReply],
                      timeout: float) -> Rep: ...


class Fetched(NamedTuple):
    """The cached prefix: payloads and where each came from, and the lease to release. Verified,
    unless ``layers`` is the source still reading them layer by layer (service/prefix_layers.py)."""

    payloads: list[memoryview] | list[bytearray]
    locations: list[BlockLocation]
    lease_id: str | None
    layers: LayerSource | None = None


def planned_key(placement: BlockLocation) -> bytes:
    """A placement from a put plan always names the block it is for."""
    assert placement.key is not None
    return placement.key


class PoolClient:
    def __init__(self, service: PoolPeer, transfer: TransferClient, layout: BlockLayout) -> None:
        self.service = service
        self.transfer = transfer
        self.layout = layout

    async def lookup(self, keys: Sequence[bytes]) -> LookupResult | None:
        """The cached prefix of ``keys``, leased (None when the cache-manager did not answer)."""
        if not keys:
            return None
        svc = self.service
        try:
            return await svc.request(svc.subjects.cache("lookup"), Lookup(keys=tuple(keys)),
                                     codecs.CACHE_LOOKUP_RESULT, CACHE_TIMEOUT_S)
        except FAILURES as exc:
            svc.log.warning("pool lookup failed; computing the whole prompt", extra={"error": str(exc)})
            return None

    async def ranged(self, locations: Sequence[BlockLocation]) -> bool:
        """Whether every block is in DRAM on a node this process reaches through byte ranges."""
        if any(loc.tier is not Tier.DRAM for loc in locations):
            return False
        try:
            return all([(await self.transfer.transport(a)).ranged for a in {loc.address for loc in locations}])
        except FAILURES:
            return False

    async def fetch_prefix(self, keys: Sequence[bytes]) -> Fetched:
        """Longest prefix of ``keys`` that is cached, readable and intact."""
        found = await self.lookup(keys)
        return await self.read_prefix(found) if found is not None else Fetched([], [], None)

    async def read_prefix(self, found: LookupResult) -> Fetched:
        """Read a looked-up prefix whole, each block from its first replica that delivers it intact."""
        svc = self.service
        first = await self.read([hit.replicas[0] for hit in found.hits])
        payloads: list[memoryview] = []
        locations: list[BlockLocation] = []
        for hit, data in zip(found.hits, first):
            for n, replica in enumerate(hit.replicas):
                payload = data if n == 0 else (await self.read([replica]))[0]
                if payload is not None and replica.key == hit.key:
                    payloads.append(payload)
                    locations.append(replica)
                    break
                svc.log.warning("cached block unusable; trying another replica",
                                extra={"key": hit.key.hex()[:16], "node": replica.address})
            else:
                break
        return Fetched(payloads, locations, found.lease_id)

    async def read(self, replicas: Sequence[BlockLocation]) -> list[memoryview | None]:
        """One batched read per node into fresh buffers, each block verified under the key it is
        stored as while the rest of the batch arrives; None where a block is missing, corrupt,
        sealed under another key, its node unreachable or its capability refused."""
        out: list[memoryview | None] = [None] * len(replicas)
        corrupt: list[BlockLocation] = []
        by_node: dict[str, list[int]] = defaultdict(list)
        for index, replica in enumerate(replicas):
            if replica.key is not None:
                by_node[replica.address].append(index)
        for node, indexes in by_node.items():
            keys = [replicas[i].key or b"" for i in indexes]
            verifier = Verifier(self.layout, keys)
            # NOTE: where the pool said the bytes are, so a same-host or one-sided read asks the node
            # nothing; a block that moved since fails its MAC below, like any other damage
            extents = [Extent(r.offset, r.size) if r.tier is Tier.DRAM else Extent(0, MISSING)
                       for r in (replicas[i] for i in indexes)]
            try:
                transport = await self.transfer.transport(node)
                views = await transport.read(keys, caps=[replicas[i].capability for i in indexes], missing_ok=True,
                                             extents=extents, check=verifier)
            except FAILURES as exc:
                self.service.log.warning("KV source unreachable", extra={"node": node, "error": str(exc)})
                continue
            for index, view, intact in zip(indexes, views, verifier.intact):
                out[index] = view if intact else None
                if view is not None and not intact:
                    corrupt.append(replicas[index])
        await self.report_corrupt(corrupt)
        return out

    async def report_corrupt(self, blocks: Sequence[BlockLocation]) -> None:
        """Have the cache-manager drop replicas that failed their MAC; otherwise every later reader of the
        prefix reads them, fails and recomputes, and nobody writes them again."""
        if not blocks:
            return
        svc = self.service
        try:
            await svc.request(svc.subjects.cache("corrupt"), CorruptBlocks(reporter=svc.instance_id,
                                                                          blocks=tuple(blocks)),
                              codecs.CACHE_ACK, CACHE_TIMEOUT_S)
        except FAILURES as exc:
            svc.log.warning("corrupt blocks not reported; they stay in the pool", extra={"error": str(exc)})

    async def release(self, lease_id: str | None) -> None:
        if lease_id is None:
            return
        svc = self.service
        try:
            await svc.request(svc.subjects.cache("release"), Release(lease_id=lease_id), codecs.CACHE_ACK,
                              CACHE_TIMEOUT_S)
        except FAILURES as exc:
            svc.log.warning("lease release failed (it expires by itself)", extra={"error": str(exc)})

    async def remove(self, keys: Sequence[bytes]) -> None:
        """Drop blocks from the pool (one-off hand-off blocks once read)."""
        if not keys:
            return
        svc = self.service
        try:
            await svc.request(svc.subjects.cache("remove"), RemoveRequest(keys=tuple(keys)), codecs.CACHE_ACK,
                              CACHE_TIMEOUT_S)
        except FAILURES as exc:
            svc.log.warning("pool remove failed", extra={"error": str(exc)})

    async def store(self, keys: Sequence[bytes], payloads: Sequence[bytearray], first_position: int,
                    tenant: str = "") -> dict[bytes, BlockLocation]:
        """put_start, seal and write the bytes to the chosen nodes, put_end; returns where each key can
        be read (the ones just stored, and those the pool already held). Payloads are sealed in place.
        Keys over ``tenant``'s quota are not stored (absent from the answer)."""
        plan = await self.place(keys, [len(p) for p in payloads], first_position, tenant)
        if plan is None:
            return {}
        payload_of = dict(zip(keys, payloads))
        sealer = Sealer(self.layout)  # each block sealed as it is sent, once for all its replicas
        known = {loc.key: loc for loc in plan.existing_replicas if loc.key is not None}
        written = await self.write(plan.placements, payload_of, sealer.hook)
        return known | await self.publish(written)

    async def place(self, keys: Sequence[bytes], sizes: Sequence[int], first_position: int,
                    tenant: str = "") -> PutPlan | None:
        """put_start: where to write each key (None when the cache-manager did not answer)."""
        if not keys:
            return None
        svc = self.service
        try:
            return await svc.request(svc.subjects.cache("put_start"),
                                     PutStart(writer=svc.instance_id, keys=tuple(keys), tenant=tenant,
                                              sizes=tuple(sizes), first_position=first_position),
                                     codecs.CACHE_PUT_PLAN, CACHE_TIMEOUT_S)
        except FAILURES as exc:
            svc.log.warning("pool put_start failed; blocks not cached", extra={"error": str(exc)})
            return None

    async def write(self, placements: Sequence[BlockLocation], payload_of: Mapping[bytes, Buffer],
                    prepare: Callable[[Sequence[bytes]], BlockHook] | None = None) -> dict[bytes, BlockLocation]:
        """Write payloads at their placements, one batch per node (``prepare(keys)``: the batch's
        transport hook, a ``Sealer``'s to seal each block as it is sent); the ones written."""
        by_node: dict[tuple[str, Tier], list[BlockLocation]] = defaultdict(list)
        for placement in placements:
            by_node[(placement.address, placement.tier)].append(placement)
        written: dict[bytes, BlockLocation] = {}
        for (node, tier), batch in by_node.items():
            try:
                transport = await self.transfer.transport(node)
                keys = [planned_key(p) for p in batch]
                await transport.write(keys, [payload_of[k] for k in keys], caps=[p.capability for p in batch],
                                      offsets=[p.offset for p in batch] if tier is Tier.DRAM else None,
                                      tier=tier, prepare=prepare(keys) if prepare else None)
            except FAILURES as exc:
                self.service.log.warning("pool write failed; those blocks stay uncached",
                                         extra={"node": node, "error": str(exc)})
                continue
            written.update((p.key, p) for p in batch if p.key is not None)
        return written

    async def publish(self, written: dict[bytes, BlockLocation]) -> dict[bytes, BlockLocation]:
        """put_end: the written blocks become visible; those it made visible (none if it failed)."""
        if not written:
            return {}
        svc = self.service
        try:
            await svc.request(svc.subjects.cache("put_end"), PutEnd(writer=svc.instance_id, keys=tuple(written)),
                              codecs.CACHE_ACK, CACHE_TIMEOUT_S)
        except FAILURES as exc:
            svc.log.warning("pool put_end failed; the put will be revoked", extra={"error": str(exc)})
            return {}
        return written
