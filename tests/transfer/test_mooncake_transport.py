"""Mooncake's transfer engine as a data-plane path, for real over its TCP transport: a block
server owns the DRAM segment, a second process registers that segment with its own engine (as
a transfer node would), and this process reads and writes it through another engine."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest

from halfmoon.core.tiers import Tier
from halfmoon.transfer.mooncake import (
    MooncakeEngine,
    MooncakeOffer,
    MooncakePath,
    MooncakeUnavailable,
)
from halfmoon.transfer.onesided import OneSidedTransport, SegmentRange
from halfmoon.transfer.server import BlockServer
from halfmoon.transfer.tcp import TcpTransport
from tests.fixtures.dataplane import Granted
from tests.transfer.test_transfer import BLOCK, key, server  # noqa: F401 (the block server fixture)

# the node's side in its own process: attach the segment by name, register it once, publish the offer
NODE = textwrap.dedent("""
    import sys, msgspec
    from halfmoon.storage.segment import AttachedSegment
    from halfmoon.transfer.mooncake import MooncakeEngine, MooncakeSegment
    seg = AttachedSegment(sys.argv[1])
    exported = MooncakeSegment(MooncakeEngine(), seg.buf)
    print(msgspec.json.encode(exported.offer()).decode(), flush=True)
    sys.stdin.read()  # serve until the test closes our stdin
""")


@pytest.fixture(scope="module")
def engine() -> MooncakeEngine:
    try:
        return MooncakeEngine()
    except MooncakeUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def offer(engine: MooncakeEngine, server: BlockServer) -> Iterator[MooncakeOffer]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", NODE, server.store.dram.segment], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"node engine exited with {proc.wait()}"
        yield msgspec.json.decode(line, type=MooncakeOffer)
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=30)


@pytest.fixture
async def mooncake(
    engine: MooncakeEngine, server: BlockServer, offer: MooncakeOffer
) -> AsyncIterator[OneSidedTransport]:
    t = OneSidedTransport(TcpTransport(server.address), MooncakePath(engine, offer))
    yield Granted(t)  # type: ignore[misc]
    await t.close()


@pytest.fixture
async def tcp(server: BlockServer) -> AsyncIterator[TcpTransport]:
    t = TcpTransport(server.address)
    yield Granted(t)  # type: ignore[misc]
    await t.close()


def fresh(n: int, tag: str) -> tuple[list[bytes], list[bytes]]:
    keys = [hashlib.sha256(f"mooncake-{tag}-{i}".encode()).digest() for i in range(n)]
    return keys, [os.urandom(BLOCK) for _ in range(n)]


class TestEngineRoundTrip:
    async def test_written_blocks_are_read_back_equal_by_engine_and_by_tcp(
        self, mooncake: OneSidedTransport, tcp: TcpTransport, server: BlockServer
    ) -> None:
        keys, data = fresh(16, "roundtrip")
        socket_bytes = server.payload_bytes_in, server.payload_bytes_out
        await mooncake.write(keys, data)
        assert [bytes(v) for v in await mooncake.read(keys)] == data
        assert (server.payload_bytes_in, server.payload_bytes_out) == socket_bytes  # no block crossed the socket
        assert [bytes(v) for v in await tcp.read(keys)] == data  # they really are in the node's segment
        assert await mooncake.delete(keys) == 16
        # 4 MiB went through the staging buffer (1 MiB at first): it grew, and only the grown one stays registered
        assert len(mooncake.path.memory.registrations) == 1

    async def test_concurrent_batches_share_the_staging_buffer_safely(self, mooncake: OneSidedTransport) -> None:
        batches = [fresh(4, f"concurrent-{i}") for i in range(4)]
        await asyncio.gather(*(mooncake.write(k, d) for k, d in batches))
        results = await asyncio.gather(*(mooncake.read(k) for k, _ in batches))
        assert [[bytes(v) for v in r] for r in results] == [d for _, d in batches]

    async def test_reads_from_pinned_memory_land_in_place(self, mooncake: OneSidedTransport) -> None:
        keys, data = fresh(4, "pinned")
        await mooncake.write(keys, data)
        dest = bytearray(4 * BLOCK)
        mooncake.pin(dest)
        views = await mooncake.read(keys, into=memoryview(dest))
        assert bytes(dest) == b"".join(data) and all(v.obj is dest for v in views)

    async def test_blocks_in_lower_tiers_come_over_tcp(self, mooncake: OneSidedTransport, tcp: TcpTransport) -> None:
        keys, data = fresh(3, "lower")
        await tcp.write(keys[1:2], data[1:2], tier=Tier.NVME)
        await mooncake.write(keys[:1] + keys[2:], data[:1] + data[2:])
        assert [bytes(v) for v in await mooncake.read(keys)] == data
        dest = memoryview(bytearray(3 * BLOCK))
        await mooncake.read(keys, into=dest)
        assert bytes(dest) == b"".join(data)  # back to back in key order, whichever tier each came from
        first, missing = await mooncake.read([keys[0], key(10_000)], missing_ok=True)
        assert bytes(first) == data[0] and missing is None


class TestLayerRanges:
    async def test_a_block_filled_layer_by_layer_reads_back_whole_and_per_layer(
        self, mooncake: OneSidedTransport, tcp: TcpTransport
    ) -> None:
        layers, layer_bytes = 8, BLOCK // 8
        (k,), (payload,) = fresh(1, "layers")
        (offset,) = await mooncake.reserve([k], [BLOCK])
        for layer in reversed(range(layers)):  # any order: each layer is its own range
            start = layer * layer_bytes
            await mooncake.write_ranges([SegmentRange(offset + start, layer_bytes)],
                                        [payload[start : start + layer_bytes]])
        assert await tcp.read([k], missing_ok=True) == [None]  # invisible until committed
        await mooncake.commit([k], [BLOCK])
        assert bytes((await tcp.read([k]))[0]) == payload
        (extent,) = await mooncake.locate([k])
        third = await mooncake.read_ranges([SegmentRange(extent.offset + 3 * layer_bytes, layer_bytes)])
        assert bytes(third[0]) == payload[3 * layer_bytes : 4 * layer_bytes]

    async def test_ranges_outside_the_segment_are_refused(self, mooncake: OneSidedTransport) -> None:
        with pytest.raises(ValueError):
            await mooncake.read_ranges([SegmentRange(mooncake.path.segment_size - 10, 20)])
        with pytest.raises(ValueError):
            await mooncake.write_ranges([SegmentRange(0, 8)], [b"four"])
