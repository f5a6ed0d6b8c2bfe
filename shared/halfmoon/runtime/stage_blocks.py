"""The KV blocks of a pipelined prefill (CPP): every stage writes its own layers of each block into one
extent the head reserved, so decode reads complete blocks as usual.

The head places the request's blocks (put_start: full blocks under their content keys, the partial last
one under its one-off key) and picks each block's header salt. Every stage fills its layer range of each
block, seals those layers under the block's key and that salt (core/block_format.py: a layer's MAC binds
the header, so the stages must agree on it) and writes their byte ranges in place (core/layer_plan.py);
the head writes the header with layer 0. Once every stage answered, the head commits and put_ends them.
Blocks on a node whose transport cannot write byte ranges are not placed (decode then recomputes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from halfmoon.core.block_format import BlockLayout, read_header, salt_block, seal_layers
from halfmoon.core.keys import handoff_key
from halfmoon.core.tiers import Tier
from halfmoon.protocol.pipeline import SALT_BYTES
from halfmoon.protocol.work import BlockLocation, KVLocation
from halfmoon.runtime.layer_writer import commit_blocks, write_layers
from halfmoon.runtime.pool_client import FAILURES, PoolClient
from halfmoon.transfer.client import TransferClient


async def write_stage_layers(transfer: TransferClient, layout: BlockLayout, blocks: Mapping[int, BlockLocation],
                             salts: Mapping[int, bytes], payloads: Sequence[bytearray], layers: range) -> set[int]:
    """Seal ``layers`` of ``payloads[index]`` under block ``index``'s key and salt and write them in place at
    ``blocks[index]``; the indexes written."""
    for index, loc in blocks.items():
        if loc.key is None or index >= len(payloads):
            raise ValueError(f"block {index} has no key or no payload")
        salt_block(payloads[index], salts[index])
        seal_layers(layout, payloads[index], loc.key, layers)
    failed = await write_layers(transfer, layout, blocks, payloads.__getitem__,
                                lambda index: read_header(payloads[index]).num_tokens, layers)
    return set(blocks) - failed


class PipelineBlocks:
    """The head's side: ``open`` (put_start), then each stage's ``write_stage_layers``, then ``finish``."""

    def __init__(self, pool: PoolClient, transfer: TransferClient, request_id: str, block_size: int, num_tokens: int,
                 keys: Sequence[bytes], prefix: Sequence[BlockLocation]) -> None:
        """``keys`` of the request's full blocks; the first ones, ``prefix``, are reused from the pool. Blocks
        are sealed in the pool's layout (it holds the cluster's MAC key)."""
        self.pool, self.transfer, self.layout = pool, transfer, pool.layout
        self.block_size, self.num_tokens = block_size, num_tokens
        count = -(-num_tokens // block_size)
        self.keys = [keys[i] if i < len(keys) else handoff_key(request_id, i) for i in range(count)]
        self.placed: dict[int, BlockLocation] = {}  # DRAM extents on nodes that write byte ranges
        self.known: dict[int, BlockLocation] = dict(enumerate(prefix))  # blocks the pool holds already
        self.salts: dict[int, bytes] = {}

    def tokens(self, index: int) -> int:
        return min(self.block_size, self.num_tokens - index * self.block_size)

    async def open(self, tenant: str = "") -> None:
        first = len(self.known)
        sizes = [self.layout.payload_nbytes(self.tokens(i)) for i in range(first, len(self.keys))]
        plan = await self.pool.place(self.keys[first:], sizes, first_position=first, tenant=tenant)
        if plan is None:
            return
        where = {key: i for i, key in enumerate(self.keys) if i >= first}
        self.known.update((where[r.key], r) for r in plan.existing_replicas if r.key in where)
        for loc in plan.placements:
            if loc.key in where and loc.tier is Tier.DRAM and await self._ranged(loc.address):
                self.placed[where[loc.key]] = loc
        self.salts = {index: os.urandom(SALT_BYTES) for index in self.placed}

    async def _ranged(self, address: str) -> bool:
        try:
            return (await self.transfer.transport(address)).ranged
        except FAILURES:
            return False

    async def write(self, payloads: Sequence[bytearray], layers: range) -> set[int]:
        """The head's own layers (its range starts at 0, so the headers go with them)."""
        return await write_stage_layers(self.transfer, self.layout, self.placed, self.salts, payloads, layers)

    async def finish(self, written: set[int]) -> KVLocation | None:
        """Commit and publish the blocks every stage wrote; where decode finds the request's KV, or None
        when a block is missing (decode then recomputes the prompt)."""
        committed = await commit_blocks(self.transfer, [self.placed[i] for i in sorted(written) if i in self.placed])
        visible = await self.pool.publish(committed)
        locations = [self.known.get(i) or visible.get(key) for i, key in enumerate(self.keys)]
        if any(loc is None for loc in locations):
            return None
        full = self.num_tokens // self.block_size
        return KVLocation(block_size=self.block_size, num_tokens=self.num_tokens,
                          blocks=tuple(loc for loc in locations[:full] if loc is not None),
                          partial=locations[full] if len(locations) > full else None)
