"""The prefill -> decode hand-off of a request's KV, both sides in one place: store, park, fetch, drop.

Prefill's ``LayerWriter`` (layer_writer.py) places the request's new blocks in the pool before
computing them (full blocks under their content keys, the partial last one under a one-off key)
and ships them layer by layer; ``send`` finishes that and parks on a transfer node's NVMe whatever
the pool had no room or answer for, unless decode was told about every layer of every new block:
then it only says where they are, and ``commit`` makes them the pool's after the hand-off. Decode
takes the blocks that arrived layer by layer (layer_reader.py), fetches the rest, verifies every
block, keeps the longest intact prefix (the rest is recomputed) and, once it is generating, drops
the one-off blocks, which nobody else will read.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from opentelemetry.trace import Tracer

from halfmoon.core.block_format import BlockLayout, Sealer
from halfmoon.core.keys import handoff_key
from halfmoon.core.tiers import Tier
from halfmoon.protocol.work import BlockLocation, KVLocation
from halfmoon.runtime.layer_writer import LayerWriter, Progress
from halfmoon.runtime.pool_client import FAILURES, Fetched, PoolClient
from halfmoon.runtime.transfer_nodes import TransferDirectory
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.capability import sign_park
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.transport import TransferError

TRANSFER_WAIT_S = 1.0  # no live node for this long: hand off without the pool (decode recomputes)
PARK_TTL_S = 300.0  # a parked block is read once by decode, soon; then the capability is useless


class KVHandOff:
    """One worker's side of the hand-off; prefill calls ``send``/``discard``, decode ``receive``."""

    def __init__(self, pool: PoolClient, transfer: TransferClient, nodes: TransferDirectory, layout: BlockLayout,
                 tracer: Tracer, log: logging.Logger, park_key: bytes) -> None:
        self.pool, self.transfer, self.nodes, self.layout = pool, transfer, nodes, layout
        self.tracer, self.log, self.park_key = tracer, log, park_key

    # ------------------------------------------------------------------ prefill side
    def writer(self, request_id: str, num_tokens: int, block_size: int, keys: Sequence[bytes], local: int,
               fetched: Fetched, progress: Progress, layerwise: bool) -> LayerWriter:
        """The request's writer (``run`` it with the compute, give its ``sink`` to the engine).

        ``keys`` are the request's full-block keys; the first ``local`` blocks came from the local
        prefix cache and the next ones ``fetched`` from the pool (already there, not written)."""
        return LayerWriter(self.pool, self.transfer, self.layout, self.tracer, request_id, block_size, num_tokens,
                           keys, local, fetched, progress, layerwise)

    async def commit(self, writer: LayerWriter) -> None:
        """After the hand-off of a ``complete`` writer: commit and publish the streamed blocks so other
        requests reuse them; the one-off ones stay uncommitted for decode to drop. A decode that lost a
        layer and reads a block whole before this lands recomputes from that block."""
        with self.tracer.start_as_current_span("prefill.kv_commit") as span:
            span.set_attribute("halfmoon.request_id", writer.request_id)
            locations = await writer.finish(one_off=False)
            span.set_attribute("halfmoon.blocks_stored", sum(loc is not None for loc in locations))

    async def send(self, writer: LayerWriter) -> KVLocation:
        """After the last layer: make every block of the request readable by decode; where each one is.

        Blocks the pool had no room, quota or answer for are parked on a transfer node's NVMe. When
        decode was told about every layer of every new block (``writer.complete``) nothing is written
        now: the blocks' locations return at once, and ``commit`` follows the hand-off."""
        with self.tracer.start_as_current_span("prefill.kv_write") as span:
            locations = writer.streamed_locations() if writer.complete else await writer.finish()
            fallback = [i for i, loc in enumerate(locations) if loc is None]
            if fallback:
                for index, parked in zip(fallback, await self._park(writer.request_id, fallback, writer.payload)):
                    locations[index] = parked
            span.set_attribute("halfmoon.blocks_streamed", len(writer.streamed))
            span.set_attribute("halfmoon.blocks_parked", len(fallback))
            span.set_attribute("halfmoon.layer_batches", len(writer.batches.batches))
        return self._location(writer, locations)

    @staticmethod
    def _location(writer: LayerWriter, locations: list[BlockLocation | None]) -> KVLocation:
        placed = [loc for loc in locations if loc is not None]  # all of them, after parking
        full = writer.num_tokens // writer.block_size
        return KVLocation(block_size=writer.block_size, num_tokens=writer.num_tokens, blocks=tuple(placed[:full]),
                          partial=placed[full] if len(placed) > full else None)

    async def discard(self, request_id: str, num_blocks: int) -> None:
        """Decode refused the request: nobody will read its one-off blocks now."""
        await self.pool.remove([handoff_key(request_id, i) for i in range(num_blocks)])

    async def _park(self, request_id: str, indexes: list[int],
                    payload: Callable[[int], bytearray]) -> list[BlockLocation]:
        """Write blocks ``indexes`` outside the pool, under their one-off keys, to the first live
        transfer node that takes them; where each one is."""
        keys = [handoff_key(request_id, i) for i in indexes]
        blocks = [payload(i) for i in indexes]
        seal = Sealer(self.layout).hook(keys)  # as each is sent, once whichever node takes it
        await self.nodes.choose(TRANSFER_WAIT_S)  # waits until at least one is known
        for node in self.nodes.ordered():
            caps = [sign_park(self.park_key, node.instance_id, request_id, i, PARK_TTL_S) for i in indexes]
            try:
                await (await self.transfer.transport(node.address)).write(keys, blocks, caps=caps, tier=Tier.NVME,
                                                                          prepare=seal)
            except (TransferError, OSError) as exc:
                self.log.warning("transfer node refused hand-off blocks",
                                 extra={"node": node.instance_id, "error": str(exc)})
                self.nodes.forget(node.instance_id)
                continue
            return [BlockLocation(address=node.address, offset=0, size=len(block), key=key, tier=Tier.NVME,
                                  capability=cap) for key, block, cap in zip(keys, blocks, caps)]
        raise TransferError("no transfer node took the hand-off blocks")

    # ------------------------------------------------------------------- decode side
    async def receive(self, request_id: str, kv: KVLocation,
                      streamed: Mapping[bytes, bytearray] | None = None) -> list[memoryview]:
        """The longest intact prefix of the request's KV (verified as it arrived, handed on without a
        copy); whatever is lost is recomputed by the caller.

        ``streamed`` are blocks that already arrived layer by layer, every layer verified (by key):
        only the others are read now. The one-off blocks stay where they are for ``drop``."""
        streamed = streamed or {}
        locations = list(kv.blocks) + ([kv.partial] if kv.partial else [])
        with self.tracer.start_as_current_span("decode.kv_read") as span:
            pending = [loc for loc in locations if loc.key not in streamed]
            read = dict(zip(map(id, pending), await self.pool.read(pending)))
            payloads = [memoryview(streamed[loc.key]) if loc.key is not None and loc.key in streamed else read[id(loc)] for loc in locations]
            span.set_attribute("halfmoon.blocks_streamed", len(locations) - len(pending))
            if any(p is None for p in payloads):
                METRICS.errors.labels("kv_read").inc()
            usable = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
            span.set_attribute("halfmoon.blocks", usable)
            span.set_attribute("halfmoon.blocks_lost", len(payloads) - usable)
            span.set_attribute("halfmoon.bytes", sum(len(p) for p in payloads[:usable] if p is not None))
        return [p for p in payloads[:usable] if p is not None]

    async def drop(self, request_id: str, kv: KVLocation) -> None:
        """After ``receive``: the request's one-off blocks are read once, so out of the pool's index, then
        off the nodes (those parked outside the pool are only on the nodes)."""
        locations = list(kv.blocks) + ([kv.partial] if kv.partial else [])
        one_off = {handoff_key(request_id, i) for i in range(len(locations))}
        scratch = [loc for loc in locations if loc.key in one_off]
        await self.pool.remove([loc.key for loc in scratch if loc.key is not None])
        by_node: dict[str, list[BlockLocation]] = defaultdict(list)
        for loc in scratch:
            if loc.key is not None:
                by_node[loc.address].append(loc)
        for node, locs in by_node.items():
            with contextlib.suppress(*FAILURES):  # the node is gone, and the blocks with it
                await (await self.transfer.transport(node)).delete([loc.key or b"" for loc in locs],
                                                                     caps=[loc.capability for loc in locs])
