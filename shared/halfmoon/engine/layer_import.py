"""Import a cached prefix's KV layer by layer, each layer just before the step computes it.

Where the KV comes from is a ``LayerSource``: payloads already in memory (``ReadyKV``), or a
prefix still arriving from the pool, one layer after another (the prefill service's), so the
transfer of layer ``l + 1`` overlaps the compute of layer ``l``. A source that cannot deliver a
layer fails only its own sequence: the engine recomputes that one and the step's others go on.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

from halfmoon.core.block_format import BlockLayout, decode_block
from halfmoon.engine.attention import PagedKVCache
from halfmoon.engine.hooks import LayerHook
from halfmoon.engine.interface import LayerSource, LayerUnavailable
from halfmoon.engine.sequence import ScheduledChunk, Sequence


class ReadyKV(LayerSource):
    """Verified pool-format payloads already in memory (a hand-off's blocks, a whole-block fetch)."""

    def __init__(self, layout: BlockLayout, payloads: Seq[bytes | bytearray | memoryview]) -> None:
        self._kv = torch.cat([decode_block(layout, p) for p in payloads], dim=2)

    @property
    def num_tokens(self) -> int:
        return self._kv.shape[2]

    def layer(self, layer: int) -> torch.Tensor:
        return self._kv[layer]


class _Pending(NamedTuple):
    seq: Sequence
    block_ids: list[int]
    offset: int  # tokens of the source the local cache already covers


class LayerImport(LayerHook):
    """The engine's hook: before layer ``l`` computes, copies layer ``l`` of each pending import into
    its sequence's blocks. ``failed`` lists the sequences whose source gave out; their KV is garbage
    from that layer on, and the engine must recompute them rather than use this step's output."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []
        self.failed: list[Sequence] = []

    def expect(self, seq: Sequence, block_ids: list[int], offset: int) -> None:
        self._pending.append(_Pending(seq, block_ids, offset))

    def idle(self, chunks: Seq[ScheduledChunk]) -> bool:
        return not self._pending

    def before_layer(self, layer: int, chunks: Seq[ScheduledChunk], cache: PagedKVCache) -> None:
        for pending in list(self._pending):
            source = pending.seq.kv_import
            assert source is not None
            try:
                kv = source.layer(layer)
            except LayerUnavailable:
                self._pending.remove(pending)
                self.failed.append(pending.seq)
                continue
            cache.load_blocks(pending.block_ids, kv[None, :, pending.offset:], first_layer=layer)

    def finish(self) -> list[Sequence]:
        """End of the step: the sequences whose import failed (the rest are complete)."""
        for pending in self._pending:
            self._close(pending.seq)
        failed, self.failed, self._pending = self.failed, [], []
        for seq in failed:
            self._close(seq)
        return failed

    @staticmethod
    def _close(seq: Sequence) -> None:
        if seq.kv_import is not None:
            seq.kv_import.close()
        seq.kv_import = seq.kv_load_from = None
