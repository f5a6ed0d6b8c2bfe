"""A prompt's new full blocks, stored into the pool layer by layer while vLLM computes the layers after.

The connector's worker side (connectors/vllm_worker.py) starts ``store`` as the step begins, which places
the blocks (put_start), hands each layer to it as vLLM's attention finishes it (``sink``, on vLLM's thread),
and the store commits and publishes them (put_end) once the last layer is written: what the step's end waits for is the commit, not
the writes. Every layer is sealed (its MAC, under the block's key and the salt its header carries) before its bytes leave.
Blocks placed where this process cannot write byte ranges (TCP, NVMe, S3) are written whole at the end,
as ``PoolClient.store`` writes them. The writes of a Halfmoon prefill service follow the same plan
(runtime/layer_writer.py), which also announces each layer to a decode instance waiting on it; vLLM's
decode side finds the blocks in the pool instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from opentelemetry.trace import Tracer

from halfmoon.core.block_format import BlockLayout, Sealer, salt_block, seal_layers
from halfmoon.protocol.work import BlockLocation
from halfmoon.runtime.layer_writer import commit_blocks, write_layers
from halfmoon.runtime.pool_client import PoolClient

Schedule = Callable[[Callable[[], None]], None]  # runs a callback on the pool session's loop, from any thread


class LayerStore:
    """``store`` on the session's loop (start it before the first layer is computed), ``sink(layer)`` from
    the engine's thread once each layer's KV is in ``payloads``; ``store`` returns after the last layer,
    with the keys the pool holds, and where. Its spans (a ``vllm.kv_layer_store`` per layer written in
    place) are children of the span current where it runs."""

    def __init__(self, pool: PoolClient, tracer: Tracer, request_id: str, keys: Sequence[bytes],
                 payloads: Sequence[bytearray], first_position: int, block_size: int, schedule: Schedule) -> None:
        self.pool, self.tracer, self.request_id = pool, tracer, request_id
        self.keys, self.payloads, self.first_position = list(keys), list(payloads), first_position
        self.block_size, self._schedule = block_size, schedule
        self.layout: BlockLayout = pool.layout
        self.known: dict[bytes, BlockLocation] = {}  # keys the pool held already
        self.streamed: dict[int, BlockLocation] = {}  # DRAM extents on nodes that take byte ranges
        self.whole: list[BlockLocation] = []  # the other placements
        self._layers: asyncio.Queue[tuple[int, int]] = asyncio.Queue()  # (layer, when its KV was in, ns)

    def sink(self, layer: int) -> None:
        """Layer ``layer`` of every payload is computed (any thread)."""
        item = (layer, time.time_ns())
        self._schedule(lambda: self._layers.put_nowait(item))

    async def store(self) -> dict[bytes, BlockLocation]:
        await self._run()
        return await self._finish()

    async def _run(self) -> None:
        """Place the blocks, then write each layer as it is sunk; returns after the last layer."""
        plan = await self.pool.place(self.keys, [len(p) for p in self.payloads], self.first_position)
        if plan is not None:
            self.known = {loc.key: loc for loc in plan.existing_replicas if loc.key is not None}
            index = {key: i for i, key in enumerate(self.keys)}
            for loc in plan.placements:
                if loc.key not in index:
                    continue
                if await self.pool.ranged([loc]):
                    self.streamed[index[loc.key]] = loc
                    salt_block(self.payloads[index[loc.key]])
                else:
                    self.whole.append(loc)
        while True:
            layer, computed = await self._layers.get()
            if self.streamed:
                await self._write(layer, computed)
            if layer == self.layout.num_layers - 1:
                return

    async def _write(self, layer: int, computed: int) -> None:
        """One layer of every streamed block, sealed and written in place; a block whose node failed is
        written whole at the end instead. The span starts when the layer's KV was in."""
        with self.tracer.start_as_current_span("vllm.kv_layer_store", start_time=computed,
                                               attributes={"halfmoon.request_id": self.request_id,
                                                           "halfmoon.layer": layer,
                                                           "halfmoon.blocks": len(self.streamed)}):
            layers = range(layer, layer + 1)
            for index, loc in self.streamed.items():
                assert loc.key is not None
                seal_layers(self.layout, self.payloads[index], loc.key, layers)
            failed = await write_layers(self.pool.transfer, self.layout, self.streamed, self.payloads.__getitem__,
                                        lambda _index: self.block_size, layers)
        for index in failed:
            self.whole.append(self.streamed.pop(index))

    async def _finish(self) -> dict[bytes, BlockLocation]:
        """Commit the blocks written layer by layer, write the others whole, put_end."""
        written = await commit_blocks(self.pool.transfer, list(self.streamed.values()))
        payload_of = {key: self.payloads[i] for i, key in enumerate(self.keys)}
        written |= await self.pool.write(self.whole, payload_of, Sealer(self.layout).hook)
        return self.known | await self.pool.publish(written)
