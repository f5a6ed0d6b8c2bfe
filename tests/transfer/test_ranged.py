"""Byte ranges of placed blocks (one layer each) over shared memory: written and read before the
block is committed, visible under its key after; TCP says it moves whole blocks only."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

import pytest
import torch

from halfmoon.core.block_format import BlockLayout, encode_block, salt_block, seal_layers, verify_layer
from halfmoon.core.cluster_keys import DEV_KEYS
from halfmoon.core.layer_plan import layer_ranges
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.server import BlockServer
from halfmoon.transfer.transport import SegmentRange, TransferError
from tests.fixtures.dataplane import Granted
from tests.transfer.test_transfer import server  # noqa: F401  (fixture)

LAYOUT = BlockLayout(hashlib.sha256(b"ranged").digest(), torch.float32, 3, 2, 8, DEV_KEYS.kv_mac)
KEY = hashlib.sha256(b"ranged-0").digest()


@pytest.fixture
async def client() -> AsyncIterator[TransferClient]:
    client = TransferClient()
    yield client
    await client.close()


class TestLayersBeforeCommit:
    async def test_each_layer_lands_and_verifies_before_the_commit(self, client: TransferClient,
                                                                   server: BlockServer) -> None:
        transport = Granted(await client.transport(server.address))
        assert transport.ranged
        payload = encode_block(LAYOUT, torch.randn(3, 2, 16, 2, 8))
        salt_block(payload)
        offset = 4096  # as if the cache-manager placed it here
        received = bytearray(len(payload))
        for layer in range(3):
            seal_layers(LAYOUT, payload, KEY, range(layer, layer + 1))
            ranges = layer_ranges(LAYOUT, 16, range(layer, layer + 1))
            await transport.write_ranges([SegmentRange(offset + r.offset, r.length) for r in ranges],
                                         [memoryview(payload)[r.offset:r.end] for r in ranges])
            views = await transport.read_ranges([SegmentRange(offset + r.offset, r.length) for r in ranges])
            for r, view in zip(ranges, views):
                received[r.offset:r.end] = view
            assert verify_layer(LAYOUT, received, layer, KEY)
        assert (await transport.read([KEY], missing_ok=True)) == [None]  # not committed yet
        await transport.commit([KEY], [len(payload)], [offset])
        (stored,) = await transport.read([KEY])
        assert bytes(stored) == bytes(payload) == bytes(received)

    async def test_ranges_outside_the_segment_are_refused(self, client: TransferClient, server: BlockServer) -> None:
        transport = await client.transport(server.address)
        with pytest.raises(ValueError, match="inside"):
            await transport.read_ranges([SegmentRange(server.store.dram.capacity - 4, 8)])


class TestWholeBlocksOnly:
    async def test_tcp_refuses_ranges(self, server: BlockServer) -> None:
        client = TransferClient(same_host=False)
        transport = await client.transport(server.address)
        assert not transport.ranged
        with pytest.raises(TransferError, match="whole blocks"):
            await transport.read_ranges([SegmentRange(0, 8)])
        await client.close()
