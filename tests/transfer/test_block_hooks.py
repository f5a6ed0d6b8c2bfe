"""Per-block hooks of a batch: blocks sealed as they are sent, verified as they land (TCP and
shared memory), with a block rewritten in place still caught on that path."""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import AsyncIterator

import pytest
import torch

from halfmoon.core.block_format import FIXED, BlockLayout, Sealer, Verifier, encode_block, verify_block
from halfmoon.core.cluster_keys import DEV_KEYS
from halfmoon.core.tiers import Tier
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.server import BlockServer
from halfmoon.transfer.transport import Transport
from tests.fixtures.dataplane import Granted
from tests.transfer.test_transfer import server  # noqa: F401  (fixture)

LAYOUT = BlockLayout(hashlib.sha256(b"hooks").digest(), torch.float16, 4, 2, 64, DEV_KEYS.kv_mac)


def key(i: int) -> bytes:
    return hashlib.sha256(f"hooks-{i}".encode()).digest()


def unsealed(n: int) -> tuple[list[bytes], list[bytearray]]:
    gen = torch.Generator().manual_seed(n)
    return [key(i) for i in range(n)], [encode_block(LAYOUT, torch.randn(4, 2, 16, 2, 64, generator=gen))
                                        for _ in range(n)]


@pytest.fixture(params=["tcp", "shm"])
async def transport(request: pytest.FixtureRequest, server: BlockServer) -> AsyncIterator[Transport]:
    client = TransferClient(same_host=request.param == "shm")
    inner = (await client.paths(server.address))[0].transport  # the fastest path, alone
    assert type(inner).__name__.lower().startswith(request.param)
    yield Granted(inner)  # type: ignore[misc]
    await client.close()


def rewrite_in_segment(server: BlockServer, k: bytes, forged: bytes) -> None:
    """What any same-host process that maps the segment can do."""
    offset = server.store.dram.locate(k).offset
    fd = os.open(f"/dev/shm/{server.store.dram.segment.lstrip('/')}", os.O_RDWR)
    with mmap.mmap(fd, 0) as shm:
        shm[offset : offset + len(forged)] = forged
    os.close(fd)


class TestSealedAsSent:
    @pytest.mark.parametrize("tier", [Tier.DRAM, Tier.NVME])
    async def test_every_block_is_stored_sealed_under_its_key(self, transport: Transport, tier: Tier) -> None:
        keys, payloads = unsealed(6)
        assert not any(verify_block(LAYOUT, p, k) for k, p in zip(keys, payloads))
        await transport.write(keys, payloads, tier=tier, prepare=Sealer(LAYOUT).hook(keys))
        stored = await transport.read(keys)
        assert [bytes(v) for v in stored] == [bytes(p) for p in payloads]  # sealed in place, then sent
        assert all(verify_block(LAYOUT, v, k) for k, v in zip(keys, stored))

    async def test_a_key_written_to_two_places_is_sealed_once(self, transport: Transport) -> None:
        keys, payloads = unsealed(2)
        sealer = Sealer(LAYOUT)
        await transport.write(keys, payloads, prepare=sealer.hook(keys))
        salts = [bytes(p[FIXED.size - 16 : FIXED.size]) for p in payloads]
        await transport.write(keys, payloads, tier=Tier.NVME, prepare=sealer.hook(keys))  # a second replica
        assert [bytes(p[FIXED.size - 16 : FIXED.size]) for p in payloads] == salts


class TestVerifiedAsLanded:
    async def test_intact_blocks_pass_and_missing_ones_are_not_checked(self, transport: Transport) -> None:
        keys, payloads = unsealed(4)
        await transport.write(keys, payloads, prepare=Sealer(LAYOUT).hook(keys))
        names = [keys[0], key(99), *keys[1:]]
        seen: list[int] = []
        verifier = Verifier(LAYOUT, names)

        def check(index: int, view: memoryview) -> None:
            seen.append(index)
            verifier(index, view)

        views = await transport.read(names, missing_ok=True, check=check)
        assert views[1] is None and sorted(seen) == [0, 2, 3, 4]
        assert verifier.intact == [True, False, True, True, True]

    async def test_a_block_rewritten_in_place_fails_only_itself(self, transport: Transport, server: BlockServer) -> None:
        keys, payloads = unsealed(3)
        await transport.write(keys, payloads, prepare=Sealer(LAYOUT).hook(keys))
        forged = bytearray(payloads[1])
        forged[-1] ^= 0x01  # one bit of the last layer
        rewrite_in_segment(server, keys[1], bytes(forged))
        verifier = Verifier(LAYOUT, keys)
        views = await transport.read(keys, into=memoryview(bytearray(sum(map(len, payloads)))), check=verifier)
        assert bytes(views[1]) == bytes(forged)  # the node serves what is there...
        assert verifier.intact == [True, False, True]  # ...and the check, on the reader's copy, refuses it
        rewrite_in_segment(server, keys[2], bytes(payloads[0]))  # a valid block, sealed under another key
        verifier = Verifier(LAYOUT, keys)
        await transport.read(keys, check=verifier)
        assert verifier.intact == [True, False, False]


class TestFailingHooks:
    async def test_a_hook_that_raises_fails_the_call_and_the_transport_still_serves(self, transport: Transport) -> None:
        keys, payloads = unsealed(3)

        def refuse(index: int, view: memoryview) -> None:
            if index == 1:
                raise RuntimeError("hook refused block 1")

        with pytest.raises(RuntimeError, match="block 1"):
            await transport.write(keys, payloads, prepare=refuse)
        await transport.write(keys, payloads)
        with pytest.raises(RuntimeError, match="block 1"):
            await transport.read(keys, check=refuse)
        assert [bytes(v) for v in await transport.read(keys)] == [bytes(p) for p in payloads]
