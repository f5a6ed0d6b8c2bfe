"""A cached prefix read from the pool layer by layer while the engine computes the new tokens.

The event loop reads layer ``l`` of every prefix block (one ``read_ranges`` per node), verifies
each layer's MAC and marks it arrived (a ``pool.layer_read`` span per layer); the engine thread,
about to compute layer ``l``, waits for exactly that (``LayerSource.layer``). So the transfer of the next layers overlaps the
compute of this one, as Mooncake's layer-wise prefill loads do. Blocks sit on nodes whose
transport moves byte ranges (shared memory, RDMA, Mooncake) and in their DRAM tier; anything
else is read whole before the compute (``PoolClient.fetch_prefix``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence

import torch
from opentelemetry.trace import Tracer

from halfmoon.core.block_format import BlockLayout, LayerVerifier
from halfmoon.core.layer_plan import layer_ranges
from halfmoon.engine.interface import LayerSource, LayerUnavailable
from halfmoon.protocol.work import BlockLocation
from halfmoon.runtime.pool_client import FAILURES
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.transport import SegmentRange

LAYER_WAIT_S = 10.0  # how long the engine waits for one layer before it recomputes the request instead


class PrefixLayers(LayerSource):
    """Contract: ``start`` begins the reads (on the running loop); ``layer(l)`` (engine thread)
    returns layer ``l`` of the blocks in order once it is in and intact, and raises
    ``LayerUnavailable`` if a read failed, a MAC did not match or nothing came within
    ``wait_s``; ``payloads`` are the blocks' bytes, whole once every layer arrived."""

    def __init__(self, layout: BlockLayout, blocks: Sequence[BlockLocation], block_size: int,
                 transfer: TransferClient, tracer: Tracer, log: logging.Logger,
                 report_corrupt: Callable[[Sequence[BlockLocation]], Awaitable[None]], wait_s: float = LAYER_WAIT_S,
                 span_name: str = "prefill.prefix_layers") -> None:
        self.layout, self.blocks, self.block_size = layout, list(blocks), block_size
        self.span_name = span_name
        self.report_corrupt = report_corrupt
        self.transfer, self.tracer, self.log, self.wait_s = transfer, tracer, log, wait_s
        self.payloads = [bytearray(loc.size) for loc in self.blocks]
        self._checks = [LayerVerifier(layout, payload, loc.key or b"", block_size)
                        for payload, loc in zip(self.payloads, self.blocks)]
        self._bodies = [check.body() for check in self._checks]  # views: filled in as layers land
        self._arrived = 0  # leading layers in and verified
        self._failure = ""
        self._changed = threading.Condition()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size  # a prefix is whole blocks

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._read_all())

    async def _read_all(self) -> None:
        with self.tracer.start_as_current_span(self.span_name) as span:
            span.set_attribute("halfmoon.blocks", len(self.blocks))
            try:
                for layer in range(self.layout.num_layers):
                    with self.tracer.start_as_current_span("pool.layer_read") as read:
                        read.set_attribute("halfmoon.layer", layer)
                        await self._read(layer)
                    self._advance(layer + 1, "")
                    # NOTE: a same-host read never suspends: without this the loop would run every layer's
                    # read before anything else, the caller's wait for ``start`` included
                    await asyncio.sleep(0)
            except (*FAILURES, LayerUnavailable) as exc:
                METRICS.errors.labels("prefix_layer_lost").inc()
                self.log.warning("layer-wise prefix read failed; the request is recomputed",
                                 extra={"error": str(exc), "layer": self._arrived})
                span.set_attribute("halfmoon.failed_at_layer", self._arrived)
                self._advance(self._arrived, f"{type(exc).__name__}: {exc}")

    async def _read(self, layer: int) -> None:
        by_node: dict[str, list[int]] = defaultdict(list)
        for index, loc in enumerate(self.blocks):
            by_node[loc.address].append(index)
        for address, indexes in by_node.items():
            ranges, targets = [], []
            for index in indexes:
                view = memoryview(self.payloads[index])
                for r in layer_ranges(self.layout, self.block_size, range(layer, layer + 1)):
                    ranges.append(SegmentRange(self.blocks[index].offset + r.offset, r.length))
                    targets.append(view[r.offset:r.end])
            views = await (await self.transfer.transport(address)).read_ranges(ranges)
            for target, view in zip(targets, views):
                target[:] = view
        failed = [index for index, check in enumerate(self._checks) if not check.intact(layer)]
        if failed:
            await self.report_corrupt([self.blocks[i] for i in failed])
            raise LayerUnavailable(f"blocks {failed} layer {layer} failed their MAC")

    def _advance(self, arrived: int, failure: str) -> None:
        with self._changed:
            self._arrived, self._failure = arrived, failure
            self._changed.notify_all()

    def layer(self, layer: int) -> torch.Tensor:
        with self._changed:
            if not self._changed.wait_for(lambda: self._arrived > layer or bool(self._failure), self.wait_s):
                raise LayerUnavailable(f"prefix layer {layer} did not arrive within {self.wait_s} s")
            if self._arrived <= layer:
                raise LayerUnavailable(f"prefix layer {layer} lost: {self._failure}")
        return torch.cat([body[layer] for body in self._bodies], dim=1)

    def close(self) -> None:
        if self._task is not None and self._loop is not None and not self._task.done():
            with contextlib.suppress(RuntimeError):  # the loop already closed (shutdown): nothing left to stop
                self._loop.call_soon_threadsafe(self._task.cancel)

    async def wait(self) -> bool:
        """Until the reads end (the engine is done with this source); whether every layer arrived."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        return self._arrived == self.layout.num_layers
