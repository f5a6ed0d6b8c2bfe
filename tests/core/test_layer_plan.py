"""The byte ranges of a block that carry a batch of layers, and sealing a block layer by layer."""

from __future__ import annotations

import pytest
import torch

from halfmoon.core.block_format import (
    BlockLayout,
    blank_block,
    encode_block,
    salt_block,
    seal_block,
    seal_layers,
    verify_block,
    verify_layer,
)
from halfmoon.core.layer_plan import ByteRange, LayerBatches, layer_ranges

LAYOUT = BlockLayout(fingerprint=bytes(range(32)), dtype=torch.float32, num_layers=3, num_kv_heads=2, head_dim=4)
KEY = bytes([7]) * 32


def block(tokens: int = 5, seed: int = 0) -> bytearray:
    kv = torch.randn(LAYOUT.num_layers, 2, tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim,
                     generator=torch.Generator().manual_seed(seed))
    return encode_block(LAYOUT, kv)


class TestLayerRanges:
    def test_every_layer_at_once_is_the_whole_payload(self) -> None:
        assert layer_ranges(LAYOUT, 5, range(3)) == [ByteRange(0, LAYOUT.payload_nbytes(5))]

    def test_layers_one_by_one_cover_every_byte_once(self) -> None:
        covered = bytearray(LAYOUT.payload_nbytes(5))
        for layer in range(3):
            for r in layer_ranges(LAYOUT, 5, range(layer, layer + 1)):
                assert not any(covered[r.offset:r.end])
                covered[r.offset:r.end] = b"\x01" * r.length
        assert all(covered)

    def test_a_reader_verifies_each_layer_as_it_lands(self) -> None:
        source = seal_block(LAYOUT, block(), KEY)
        received = bytearray(len(source))
        for layer in range(3):
            for r in layer_ranges(LAYOUT, 5, range(layer, layer + 1)):
                received[r.offset:r.end] = source[r.offset:r.end]
            assert all(verify_layer(LAYOUT, received, done, KEY) for done in range(layer + 1))
            assert layer == 2 or not verify_layer(LAYOUT, received, layer + 1, KEY)  # not arrived yet
        assert received == source

    @pytest.mark.parametrize("layers", [range(0), range(2, 4), range(0, 3, 2)])
    def test_bad_ranges_are_refused(self, layers: range) -> None:
        with pytest.raises(ValueError):
            layer_ranges(LAYOUT, 5, layers)


class TestBatches:
    def test_whole_is_one_batch_and_per_layer_one_each(self) -> None:
        assert LayerBatches.whole(3).batches == (range(3),)
        assert LayerBatches.per_layer(3).batches == (range(1), range(1, 2), range(2, 3))
        assert LayerBatches.per_layer(5, 2).batches == (range(2), range(2, 4), range(4, 5))

    def test_a_batch_completes_with_its_last_layer(self) -> None:
        batches = LayerBatches.per_layer(5, 2)
        assert [batches.completed_by(layer) for layer in range(5)] == [None, range(2), None, range(2, 4),
                                                                       range(4, 5)]
        assert LayerBatches.whole(5).completed_by(3) is None


class TestSealLayerByLayer:
    def test_sealing_each_layer_in_turn_seals_the_block(self) -> None:
        payload = block(seed=1)
        salt_block(payload)
        for layer in range(3):
            seal_layers(LAYOUT, payload, KEY, range(layer, layer + 1))
            assert verify_layer(LAYOUT, payload, layer, KEY)
        assert verify_block(LAYOUT, payload, KEY)
        assert not verify_block(LAYOUT, payload, bytes(32))

    def test_a_forged_layer_fails_alone(self) -> None:
        payload = seal_block(LAYOUT, block(seed=2), KEY)
        start = LAYOUT.header_nbytes + LAYOUT.layer_nbytes(5)
        payload[start] ^= 0xFF  # first byte of layer 1
        assert verify_layer(LAYOUT, payload, 0, KEY) and not verify_layer(LAYOUT, payload, 1, KEY)
        assert verify_layer(LAYOUT, payload, 2, KEY)

    def test_blank_block_has_the_header_of_an_encoded_one(self) -> None:
        blank, encoded = blank_block(LAYOUT, 5), block()
        assert len(blank) == len(encoded) and blank[:LAYOUT.header_nbytes] == encoded[:LAYOUT.header_nbytes]
