"""Which bytes of a block to move for which layers: the one plan behind whole-block and layer-wise hand-off.

A block is ``fixed header | tags | layer 0 | layer 1 | ...`` (core/block_format.py). Moving layers
``[a, b)`` of a block means moving their MAC tags and their bodies, and the fixed header (magic,
shape, salt) with the first batch. Adjacent ranges are merged, so the batch of every layer is one
range: the whole payload. Whole-block hand-off is therefore the layer-wise one with a single batch
(``LayerBatches.whole``), never a second code path.
"""

from __future__ import annotations

from typing import NamedTuple

from halfmoon.core.block_format import FIXED, TAG_BYTES, BlockLayout


class ByteRange(NamedTuple):
    """``length`` bytes at ``offset`` of one block's payload."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def layer_ranges(layout: BlockLayout, num_tokens: int, layers: range) -> list[ByteRange]:
    """The byte ranges of a ``num_tokens``-token block that carry ``layers`` (merged where adjacent)."""
    if not 0 <= layers.start < layers.stop <= layout.num_layers or layers.step != 1:
        raise ValueError(f"layers must be a non-empty consecutive range inside 0..{layout.num_layers}, got {layers}")
    size = layout.layer_nbytes(num_tokens)
    tags = ByteRange(FIXED.size + layers.start * TAG_BYTES, len(layers) * TAG_BYTES)
    body = ByteRange(layout.header_nbytes + layers.start * size, len(layers) * size)
    parts = ([ByteRange(0, FIXED.size)] if layers.start == 0 else []) + [tags] + ([body] if size else [])
    merged = [parts[0]]
    for part in parts[1:]:
        last = merged[-1]
        if last.end == part.offset:
            merged[-1] = ByteRange(last.offset, last.length + part.length)
        else:
            merged.append(part)
    return merged


class LayerBatches(NamedTuple):
    """The layers of a model cut into consecutive batches, each moved (and announced) as one unit."""

    batches: tuple[range, ...]

    @classmethod
    def whole(cls, num_layers: int) -> LayerBatches:
        return cls((range(num_layers),))

    @classmethod
    def per_layer(cls, num_layers: int, layers_per_batch: int = 1) -> LayerBatches:
        if num_layers < 1 or layers_per_batch < 1:
            raise ValueError("need at least one layer and one layer per batch")
        step = layers_per_batch
        return cls(tuple(range(a, min(a + step, num_layers)) for a in range(0, num_layers, step)))

    def completed_by(self, layer: int) -> range | None:
        """The batch that is complete once ``layer`` is computed (layers complete in order), if any."""
        return next((batch for batch in self.batches if batch.stop - 1 == layer), None)
