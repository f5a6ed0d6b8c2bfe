"""Prefill's side of the hand-off, layer by layer: place the request's new blocks before computing,
ship each batch of layers as the engine finishes it, tell decode, and commit at the end (after the
hand-off when decode holds every block already: ``complete``).

Whole-block hand-off is this with one batch of every layer (``LayerBatches.whole``); blocks whose
node's transport cannot write byte ranges (TCP) are written whole once the last layer is done.
Every layer is sealed (its MAC) before it leaves, so decode verifies each layer it reads.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence

from nats.errors import Error as NatsError
from opentelemetry.trace import Tracer

from halfmoon.core.block_format import BlockLayout, Sealer, salt_block, seal_layers
from halfmoon.core.keys import handoff_key
from halfmoon.core.layer_plan import LayerBatches, layer_ranges
from halfmoon.core.tiers import Tier
from halfmoon.protocol.cache import PutPlan
from halfmoon.protocol.work import BlockLocation, KVProgress
from halfmoon.runtime.pool_client import FAILURES, Fetched, PoolClient
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.transport import SegmentRange, Transport

Progress = Callable[[KVProgress], Awaitable[None]]


class LayerWriter:
    """One request, built on the event loop. ``run`` places the blocks and ships the layers (start it
    with the compute: the engine's first layers wait in a queue while put_start is answered), ``sink``
    is the engine's layer sink, ``finish`` after the last layer returns where every block is (None
    where nothing took it: the caller parks it)."""

    def __init__(self, pool: PoolClient, transfer: TransferClient, layout: BlockLayout, tracer: Tracer,
                 request_id: str, block_size: int, num_tokens: int, keys: Sequence[bytes], local: int,
                 fetched: Fetched, progress: Progress, layerwise: bool) -> None:
        self.pool, self.transfer, self.layout, self.tracer = pool, transfer, layout, tracer
        self.request_id, self.block_size, self.num_tokens = request_id, block_size, num_tokens
        count = -(-num_tokens // block_size)
        self.keys = [keys[i] if i < len(keys) else handoff_key(request_id, i) for i in range(count)]
        self.one_off = range(min(len(keys), count), count)  # under handoff keys: decode reads them once
        self.fetched, self.fetched_range = fetched, range(local, local + len(fetched.payloads))
        self.progress, self.layerwise = progress, layerwise
        self.first_block = 0 if local else self.fetched_range.stop  # the engine streams from here
        self.placed: dict[int, BlockLocation] = {}
        self.known: dict[int, BlockLocation] = {}
        self.streamed: list[int] = []  # placed in DRAM on a node whose transport writes ranges
        self.batches = LayerBatches.whole(layout.num_layers)
        self.payloads: list[bytearray] = []
        self.announced = 0  # layers decode was told about (KVProgress sent)
        self._layers: asyncio.Queue[int] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()

    def tokens(self, index: int) -> int:
        return min(self.block_size, self.num_tokens - index * self.block_size)

    @property
    def new_blocks(self) -> list[int]:
        """The blocks to write: all but those fetched from the pool."""
        return [i for i in range(len(self.keys)) if i not in self.fetched_range]

    async def open(self, tenant: str = "") -> None:
        """Place the new blocks (put_start) and choose the batches."""
        head = [i for i in self.new_blocks if i < self.fetched_range.start]
        tail = [i for i in self.new_blocks if i >= self.fetched_range.stop]
        plans = await asyncio.gather(*(self._place(part, tenant) for part in (head, tail) if part))
        for part, plan in zip([p for p in (head, tail) if p], plans):
            if plan is not None:
                self._take(part, plan)
        for index, loc in sorted(self.placed.items()):
            if loc.tier is Tier.DRAM and (await self._transport(loc.address)) is not None:
                self.streamed.append(index)
        if self.layerwise and self.streamed:
            self.batches = LayerBatches.per_layer(self.layout.num_layers)

    async def _place(self, indexes: list[int], tenant: str) -> PutPlan | None:
        sizes = [self.layout.payload_nbytes(self.tokens(i)) for i in indexes]
        return await self.pool.place([self.keys[i] for i in indexes], sizes, first_position=indexes[0], tenant=tenant)

    def _take(self, indexes: list[int], plan: PutPlan) -> None:
        where = {self.keys[i]: i for i in indexes}
        self.placed.update((where[p.key], p) for p in plan.placements if p.key in where)
        self.known.update((where[r.key], r) for r in plan.existing_replicas if r.key in where)

    async def _transport(self, address: str) -> Transport | None:
        try:
            transport = await self.transfer.transport(address)
        except FAILURES:
            return None
        return transport if transport.ranged else None

    def sink(self, layer: int, payloads: list[bytearray]) -> None:
        """The engine's layer sink (engine thread): hand the layer to the loop."""
        self.payloads = payloads
        self._loop.call_soon_threadsafe(self._layers.put_nowait, layer)

    def payload(self, index: int) -> bytearray:
        return self.payloads[index - self.first_block]

    async def run(self, tenant: str = "") -> None:
        """Place the blocks, then ship each batch of layers as its last layer is computed; returns
        after the last batch."""
        await self.open(tenant)
        while True:
            layer = await self._layers.get()
            batch = self.batches.completed_by(layer)
            if batch is not None:
                await self._ship(batch)
            if layer == self.layout.num_layers - 1:
                return

    async def _ship(self, layers: range) -> None:
        with self.tracer.start_as_current_span("prefill.kv_layers") as span:
            span.set_attribute("halfmoon.request_id", self.request_id)
            span.set_attribute("halfmoon.layers_done", layers.stop)
            for index in self.streamed:
                payload = self.payload(index)
                if layers.start == 0:
                    salt_block(payload)
                seal_layers(self.layout, payload, self.keys[index], layers)
            failed = await write_layers(self.transfer, self.layout, {i: self.placed[i] for i in self.streamed},
                                        self.payload, self.tokens, layers)
            self.streamed = [i for i in self.streamed if i not in failed]  # written whole at the end
            span.set_attribute("halfmoon.blocks", len(self.streamed))
            if self.streamed:
                await self._announce(layers)

    async def _announce(self, layers: range) -> None:
        try:
            await self.progress(KVProgress(request_id=self.request_id, block_size=self.block_size,
                                           num_tokens=self.num_tokens, indexes=tuple(self.streamed),
                                           blocks=tuple(self.placed[i] for i in self.streamed),
                                           layers_done=layers.stop))
            self.announced = layers.stop
        except NatsError:
            pass  # an optimisation only: decode reads whole whatever it was not told about

    @property
    def complete(self) -> bool:
        """Whether decode gets every new block from the layers it was told about (every layer of every
        block announced, or the block was in the pool already): nothing needs writing, committing or
        publishing before the hand-off, so those can follow it."""
        streamed = set(self.streamed) | set(self.known)
        return self.announced == self.layout.num_layers and all(i in streamed for i in self.new_blocks)

    def streamed_locations(self) -> list[BlockLocation | None]:
        """Where each block is for a ``complete`` writer, before any commit: the streamed blocks' placed
        (still uncommitted) extents, which decode read layer by layer."""
        return self.locations({self.keys[i]: self.placed[i] for i in self.streamed})

    def locations(self, visible: dict[bytes, BlockLocation]) -> list[BlockLocation | None]:
        out: list[BlockLocation | None] = []
        for index, key in enumerate(self.keys):
            if index in self.fetched_range:
                out.append(self.fetched.locations[index - self.fetched_range.start])
            else:
                out.append(self.known.get(index) or visible.get(key))
        return out

    async def finish(self, one_off: bool = True) -> list[BlockLocation | None]:
        """Commit the streamed blocks, write the others whole, put_end; where each block is. Without
        ``one_off`` the streamed one-off blocks are left uncommitted: decode, which read them already,
        drops them (a commit after its drop would leave them on the node)."""
        written = await commit_blocks(self.transfer, [self.placed[i] for i in self.streamed
                                                      if one_off or i not in self.one_off])
        whole = [i for i in self.placed if i not in self.streamed]
        payload_of = {self.keys[i]: self.payload(i) for i in whole}
        written |= await self.pool.write([self.placed[i] for i in whole], payload_of, Sealer(self.layout).hook)
        return self.locations(await self.pool.publish(written))


async def write_layers(transfer: TransferClient, layout: BlockLayout, blocks: Mapping[int, BlockLocation],
                       payload: Callable[[int], bytearray], tokens: Callable[[int], int], layers: range) -> set[int]:
    """Write ``layers`` of each block (sealed already) into its DRAM extent ``blocks[index]``, one batch per
    node; the indexes of the blocks whose node failed."""
    by_node: dict[str, list[int]] = defaultdict(list)
    for index, loc in blocks.items():
        by_node[loc.address].append(index)
    failed: set[int] = set()
    for address, indexes in by_node.items():
        ranges, parts = [], []
        for index in indexes:
            base, view = blocks[index].offset, memoryview(payload(index))
            for r in layer_ranges(layout, tokens(index), layers):
                ranges.append(SegmentRange(base + r.offset, r.length))
                parts.append(view[r.offset:r.end])
        try:
            await (await transfer.transport(address)).write_ranges(ranges, parts)
        except FAILURES:
            failed.update(indexes)
    return failed


async def commit_blocks(transfer: TransferClient, locations: Sequence[BlockLocation]) -> dict[bytes, BlockLocation]:
    """Make blocks written in place at their DRAM extents readable on their nodes; the committed ones by key."""
    by_node: dict[str, list[BlockLocation]] = defaultdict(list)
    for loc in locations:
        by_node[loc.address].append(loc)
    written: dict[bytes, BlockLocation] = {}
    for address, locs in by_node.items():
        try:
            await (await transfer.transport(address)).commit(
                [loc.key or b"" for loc in locs], [loc.size for loc in locs], [loc.offset for loc in locs],
                [loc.capability for loc in locs])
        except FAILURES:
            continue
        written.update((loc.key, loc) for loc in locs if loc.key is not None)
    return written
