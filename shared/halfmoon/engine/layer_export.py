"""Export a prefill-only request's KV layer by layer, as each layer is computed.

The engine fills pool-format payloads (unsealed, like ``export_kv``'s) one layer at a time from
its ``after_layer`` hook and tells the request's sink which layer is now complete, so a writer can
ship that layer while the model computes the next ones. Only the chunk that ends the prompt
triggers it: earlier chunks' KV is already in the cache by then, so after layer ``l`` of the last
chunk, layer ``l`` of every token is final.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from halfmoon.core.block_format import BlockLayout, blank_block
from halfmoon.engine.attention import PagedKVCache
from halfmoon.engine.hooks import LayerHook
from halfmoon.engine.interface import LayerSink
from halfmoon.engine.sequence import ScheduledChunk


class _Stream:
    def __init__(self, first_block: int, sink: LayerSink) -> None:
        self.first_block = first_block
        self.sink = sink
        self.payloads: list[bytearray] = []


class LayerExport(LayerHook):
    """The engine's hook: streams the layers of the requests it watches, in layer order."""

    def __init__(self, layout: BlockLayout, block_size: int) -> None:
        self.layout = layout
        self.block_size = block_size
        self._streams: dict[str, _Stream] = {}

    def watch(self, request_id: str, first_block: int, sink: LayerSink) -> None:
        """Stream blocks ``first_block`` onwards of ``request_id`` (those before are in the pool already)."""
        if first_block < 0:
            raise ValueError(f"first_block must be >= 0, got {first_block}")
        self._streams[request_id] = _Stream(first_block, sink)

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def idle(self, chunks: Seq[ScheduledChunk]) -> bool:
        return not any(chunk.samples and chunk.seq.request_id in self._streams for chunk in chunks)

    def after_layer(self, layer: int, chunks: Seq[ScheduledChunk], cache: PagedKVCache) -> None:
        for chunk in chunks:
            stream = self._streams.get(chunk.seq.request_id)
            if stream is None or not chunk.samples:
                continue
            self._copy(layer, chunk, stream, cache)
            stream.sink(layer, stream.payloads)

    def _copy(self, layer: int, chunk: ScheduledChunk, stream: _Stream, cache: PagedKVCache) -> None:
        seq, size, layout = chunk.seq, self.block_size, self.layout
        tokens = chunk.start + chunk.num_tokens
        count = -(-tokens // size)
        first = min(stream.first_block, count)
        if layer == 0:
            stream.payloads = [blank_block(layout, min(size, tokens - i * size)) for i in range(first, count)]
        fill_layer(layout, cache, layer, seq.block_table, first, tokens, stream.payloads)


def fill_layer(layout: BlockLayout, cache: PagedKVCache, layer: int, block_table: list[int], first: int, tokens: int,
               payloads: list[bytearray]) -> None:
    """Copy layer ``layer`` of blocks ``first`` onwards of a sequence of ``tokens`` tokens into ``payloads``
    (one pool-format payload per block from ``first``)."""
    if not payloads:
        return
    size = cache.block_size
    kv = cache.layer_blocks(layer, block_table[first:first + len(payloads)], tokens - first * size)
    body = kv.to("cpu", layout.dtype)
    for index, payload in enumerate(payloads):
        count = min(size, tokens - (first + index) * size)
        nbytes = layout.layer_nbytes(count)
        start = layout.header_nbytes + layer * nbytes
        part = body[:, index * size:index * size + count].contiguous()
        memoryview(payload)[start:start + nbytes] = part.view(torch.uint8).reshape(-1).numpy().data
