"""Decode's side of the layer-wise hand-off: read each batch of layers prefill announces (KVProgress)
while prefill computes the next ones, verifying every layer's MAC as it lands.

``take`` hands the blocks whose every layer arrived intact to the hand-off, which reads the rest
whole (a node that cannot move byte ranges, a layer that failed its MAC, a message that was lost).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, defaultdict, deque

from opentelemetry.context import Context
from opentelemetry.trace import Tracer

from halfmoon.core.block_format import BlockLayout, verify_layer
from halfmoon.core.layer_plan import layer_ranges
from halfmoon.protocol.work import KVProgress
from halfmoon.runtime.pool_client import FAILURES
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.transport import SegmentRange

CAPACITY = 256  # requests announced but not yet handed off; the oldest is dropped past this
ANNOUNCED_WAIT_S = 1.0  # how long the hand-off waits for the next announced batch still being read


class _Incoming:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.layers_done = 0
        self.buffers: dict[int, tuple[bytes, bytearray]] = {}  # block index -> (key, payload so far)
        self.bad: set[int] = set()
        self.progressed = asyncio.Event()  # set after each batch of layers is read


class LayerReader:
    def __init__(self, transfer: TransferClient, layout: BlockLayout, tracer: Tracer, log: logging.Logger) -> None:
        self.transfer, self.layout, self.tracer, self.log = transfer, layout, tracer, log
        self._incoming: OrderedDict[str, _Incoming] = OrderedDict()
        self._taken: deque[str] = deque(maxlen=CAPACITY)  # a late announcement of these is ignored

    async def on_progress(self, msg: KVProgress, context: Context | None = None) -> None:
        """Read the newly announced layers (``context``: the sender's trace, which the read joins)."""
        if msg.request_id in self._taken:
            return
        incoming = self._get(msg.request_id)
        async with incoming.lock:
            layers = range(incoming.layers_done, min(msg.layers_done, self.layout.num_layers))
            if not layers:
                return
            with self.tracer.start_as_current_span("decode.kv_layers", context=context) as span:
                span.set_attribute("halfmoon.request_id", msg.request_id)
                span.set_attribute("halfmoon.layers_done", layers.stop)
                await self._read(msg, layers, incoming)
                span.set_attribute("halfmoon.blocks_lost", len(incoming.bad))
            incoming.layers_done = layers.stop
            incoming.progressed.set()

    def _get(self, request_id: str) -> _Incoming:
        incoming = self._incoming.get(request_id)
        if incoming is None:
            incoming = self._incoming[request_id] = _Incoming()
            while len(self._incoming) > CAPACITY:
                self._incoming.popitem(last=False)
        return incoming

    async def _read(self, msg: KVProgress, layers: range, incoming: _Incoming) -> None:
        if layers.start:  # a block prefill stopped streaming (its write failed) lacks these layers: read it whole
            incoming.bad.update(set(incoming.buffers) - set(msg.indexes))
        by_node: dict[str, list[int]] = defaultdict(list)
        for index, loc in zip(msg.indexes, msg.blocks):
            key = loc.key or b""
            held = incoming.buffers.get(index)
            if held is None or held[0] != key or len(held[1]) != loc.size:
                if layers.start:  # earlier layers of this block were never announced: read it whole later
                    incoming.bad.add(index)
                    continue
                incoming.buffers[index] = (key, bytearray(loc.size))
            by_node[loc.address].append(index)
        where = dict(zip(msg.indexes, msg.blocks))
        for address, indexes in by_node.items():
            ranges, targets = [], []
            for index in indexes:
                view = memoryview(incoming.buffers[index][1])
                for r in layer_ranges(self.layout, msg.tokens(index), layers):
                    ranges.append(SegmentRange(where[index].offset + r.offset, r.length))
                    targets.append(view[r.offset:r.end])
            try:
                views = await (await self.transfer.transport(address)).read_ranges(ranges)
            except FAILURES as exc:
                self.log.warning("layer-wise KV read failed; reading whole blocks later",
                                 extra={"node": address, "error": str(exc)})
                incoming.bad.update(indexes)
                continue
            for target, view in zip(targets, views):
                target[:] = view
            for index in indexes:
                key, payload = incoming.buffers[index]
                if not all(verify_layer(self.layout, payload, layer, key) for layer in layers):
                    incoming.bad.add(index)

    def layers_in(self, request_id: str) -> int:
        """How many leading layers of every announced block of the request arrived intact (0 after a loss)."""
        incoming = self._incoming.get(request_id)
        return 0 if incoming is None or incoming.bad else incoming.layers_done

    async def take(self, request_id: str, announced: int = 0) -> dict[bytes, bytearray]:
        """The request's blocks that arrived whole and intact, by key; forgets the request. Waits for the
        ``announced`` layers (a KVProgress may still be on its way, or being read) while each batch
        lands within ``ANNOUNCED_WAIT_S`` of the last: a slow reader still beats reading whole, and
        prefill may commit the blocks only after the hand-off."""
        incoming = self._get(request_id) if announced else self._incoming.get(request_id)
        if incoming is not None:
            try:
                while incoming.layers_done < min(announced, self.layout.num_layers):
                    incoming.progressed.clear()
                    await asyncio.wait_for(incoming.progressed.wait(), ANNOUNCED_WAIT_S)
            except TimeoutError:
                pass  # read whole what did not arrive
        self._taken.append(request_id)
        incoming = self._incoming.pop(request_id, None)
        if incoming is None:
            return {}
        async with incoming.lock:  # an announcement being read finishes first
            if incoming.layers_done < self.layout.num_layers:
                return {}
            return {key: payload for index, (key, payload) in incoming.buffers.items() if index not in incoming.bad}
