"""The prefill -> decode hand-off of a request's KV, both sides in one place: store, park, fetch, drop.

Prefill stores the request's full blocks in the pool under their content keys (the pool answers
with where blocks it already held live), writes the partial last block under a one-off key, and
parks on a transfer node's NVMe whatever the pool had no room or answer for. Decode fetches every
block, verifies it, keeps the longest intact prefix (the rest is recomputed) and drops the one-off
blocks, which nobody else will read.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import defaultdict
from collections.abc import Sequence

from halfmoon.core.block_format import BlockLayout, verify_block
from halfmoon.core.tiers import Tier
from halfmoon.protocol.work import BlockLocation, KVLocation
from halfmoon.service.pool_client import FAILURES, Fetched, PoolClient
from halfmoon.service.transfer_nodes import TransferDirectory
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.transport import TransferError
from opentelemetry.trace import Tracer

TRANSFER_WAIT_S = 10.0


def handoff_key(request_id: str, index: int) -> bytes:
    """Key of a scratch KV block moving from prefill to decode (not a content key: never shared)."""
    return hashlib.sha256(f"handoff/{request_id}/{index}".encode()).digest()


class KVHandOff:
    """One worker's side of the hand-off; prefill calls ``send``/``discard``, decode ``receive``."""

    def __init__(self, pool: PoolClient, transfer: TransferClient, nodes: TransferDirectory, layout: BlockLayout,
                 tracer: Tracer, log: logging.Logger) -> None:
        self.pool, self.transfer, self.nodes, self.layout = pool, transfer, nodes, layout
        self.tracer, self.log = tracer, log

    # ------------------------------------------------------------------ prefill side
    async def send(self, request_id: str, num_tokens: int, block_size: int, keys: Sequence[bytes],
                   payloads: Sequence[bytes], local: int, fetched: Fetched) -> KVLocation:
        """Make every block of the request readable by decode; where each one is.

        ``keys`` are the prompt's full-block keys, ``payloads`` every block (the partial last one
        too), the first ``local`` from the local prefix cache and the next ones ``fetched`` from
        the pool (already there).
        """
        fetched_end, full = local + len(fetched.payloads), len(keys)
        # The cache-manager places them all, so one allocator owns every DRAM segment.
        head = list(keys[:local])
        tail = list(keys[fetched_end:full]) + [handoff_key(request_id, i) for i in range(full, len(payloads))]
        with self.tracer.start_as_current_span("prefill.kv_write") as span:
            stored_head, stored_tail = await asyncio.gather(
                self.pool.store(head, payloads[:local], first_position=0),
                self.pool.store(tail, payloads[fetched_end:], first_position=fetched_end))
            stored = stored_head | stored_tail
            locations: list[BlockLocation | None] = [stored.get(k) for k in head] + list(fetched.locations)
            locations += [stored.get(k) for k in tail]
            fallback = [(i, handoff_key(request_id, i)) for i, loc in enumerate(locations) if loc is None]
            if fallback:  # the pool had no room or no answer: park those blocks on a node's NVMe
                node = await self._park([k for _, k in fallback], [payloads[i] for i, _ in fallback])
                for index, key in fallback:
                    locations[index] = BlockLocation(address=node, offset=0, size=len(payloads[index]), key=key,
                                                     tier=Tier.NVME)
            span.set_attribute("halfmoon.blocks_stored", len(stored))
            span.set_attribute("halfmoon.blocks_parked", len(fallback))
            span.set_attribute("halfmoon.bytes", sum(len(payloads[i]) for i in range(local, len(payloads))))
        placed = [loc for loc in locations if loc is not None]  # all of them, after parking
        return KVLocation(block_size=block_size, num_tokens=num_tokens, blocks=tuple(placed[:full]),
                          partial=placed[full] if len(placed) > full else None)

    async def discard(self, request_id: str, num_blocks: int) -> None:
        """Decode refused the request: nobody will read its one-off blocks now."""
        await self.pool.remove([handoff_key(request_id, i) for i in range(num_blocks)])

    async def _park(self, keys: list[bytes], payloads: list[bytes]) -> str:
        """Write blocks outside the pool to the first live transfer node that takes them; its address."""
        await self.nodes.choose(TRANSFER_WAIT_S)  # waits until at least one is known
        for node in self.nodes.ordered():
            try:
                await (await self.transfer.transport(node.address)).write(keys, payloads, tier=Tier.NVME)
            except (TransferError, OSError) as exc:
                self.log.warning("transfer node refused hand-off blocks",
                                 extra={"node": node.instance_id, "error": str(exc)})
                self.nodes.forget(node.instance_id)
                continue
            return node.address
        raise TransferError("no transfer node took the hand-off blocks")

    # ------------------------------------------------------------------- decode side
    async def receive(self, request_id: str, kv: KVLocation) -> list[bytes]:
        """The longest intact prefix of the request's KV; whatever is lost is recomputed by the caller."""
        locations = list(kv.blocks) + ([kv.partial] if kv.partial else [])
        scratch = {handoff_key(request_id, i) for i in range(len(locations))}
        with self.tracer.start_as_current_span("decode.kv_read") as span:
            views = await self.pool.read(locations)
            payloads = [bytes(v) if v is not None and verify_block(self.layout, v) else None for v in views]
            if any(v is None for v in views):
                METRICS.errors.labels("kv_read").inc()
            await self._drop_scratch([loc for loc in locations if loc.key in scratch])
            usable = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
            span.set_attribute("halfmoon.blocks", usable)
            span.set_attribute("halfmoon.blocks_lost", len(payloads) - usable)
            span.set_attribute("halfmoon.bytes", sum(len(p) for p in payloads[:usable] if p is not None))
        return [p for p in payloads[:usable] if p is not None]

    async def _drop_scratch(self, scratch: list[BlockLocation]) -> None:
        """One-off blocks are read once: out of the pool's index, then off the nodes (those parked
        outside the pool are only on the nodes)."""
        await self.pool.remove([loc.key for loc in scratch if loc.key is not None])
        by_node: dict[str, list[bytes]] = defaultdict(list)
        for loc in scratch:
            if loc.key is not None:
                by_node[loc.address].append(loc.key)
        for node, keys in by_node.items():
            try:
                await (await self.transfer.transport(node)).delete(keys)
            except FAILURES:
                pass  # the node is gone, and the blocks with it
