"""The hand-off path with and without the KV block MAC, for ``benchmarks.pool_throughput``.

One round puts a batch (prefill: seal each block under its key as it is written) and gets it back
(decode: read into one buffer, verify each block under its key as it lands), as the pool client
does. Two baselines do the same moves: with layout v1's integrity check instead (a CRC-32 of each
body on both sides, what the hand-off did before), and with no check at all. All carry the node's
capabilities over an authenticated connection (the handshake is once per pooled connection, so it
is not in the rounds; checking a capability is one keyed hash of ~100 bytes per block), so the
difference is what the MAC costs.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Awaitable, Callable

import torch

from halfmoon.core.block_format import BlockLayout, Sealer, Verifier, encode_block
from halfmoon.core.cluster_keys import DEV_KEYS
from halfmoon.transfer.capability import Capability, Right, sign
from halfmoon.transfer.transport import Transport

LAYERS, TOKENS = 16, 16


def layout_for(block: int) -> BlockLayout:
    """fp16 KV of 16 tokens x 16 layers, heads x head_dim chosen so a block is ``block`` bytes of KV."""
    per_head = 2 * TOKENS * 64 * 2  # K and V, 16 tokens, head_dim 64, fp16
    heads = max(1, block // LAYERS // per_head)
    return BlockLayout(hashlib.sha256(b"bench").digest(), torch.float16, LAYERS, heads, 64, DEV_KEYS.kv_mac)


Round = Callable[[], Awaitable[None]]


def grants(keys: list[bytes]) -> list[bytes]:
    """READ and WRITE of each key, as a put_start answer grants them (the server's default node id)."""
    return [sign(DEV_KEYS.grant, Capability(int(Right.READ | Right.WRITE), "node", k, float("inf"))) for k in keys]


def handoff_cases(transport: Transport, block: int, batch: int, seed: int) -> tuple[Round, Round, Round, int]:
    """(MAC round, CRC round, unchecked round, bytes per round) for ``batch`` blocks of about ``block`` bytes."""
    layout = layout_for(block)
    keys = [hashlib.sha256(f"handoff-{seed}-{i}".encode()).digest() for i in range(batch)]
    gen = torch.Generator().manual_seed(seed)
    shape = (LAYERS, 2, TOKENS, layout.num_kv_heads, layout.head_dim)
    payloads = [encode_block(layout, torch.randn(shape, generator=gen)) for _ in keys]
    nbytes = sum(len(p) for p in payloads)
    caps = grants(keys)
    dest = memoryview(bytearray(nbytes))
    body = layout.header_nbytes

    async def with_mac() -> None:  # as the pool client does: seal each block as it is sent, verify as it lands
        await transport.write(keys, payloads, caps=caps, prepare=Sealer(layout).hook(keys))
        verifier = Verifier(layout, keys)
        await transport.read(keys, caps=caps, into=dest, check=verifier)
        assert all(verifier.intact)

    async def with_crc() -> None:
        sums = [zlib.crc32(memoryview(p)[body:]) for p in payloads]
        await transport.write(keys, payloads, caps=caps)
        views = await transport.read(keys, caps=caps, into=dest)
        assert [zlib.crc32(v[body:]) for v in views] == sums

    async def unchecked() -> None:
        await transport.write(keys, payloads, caps=caps)
        await transport.read(keys, caps=caps, into=dest)

    return with_mac, with_crc, unchecked, nbytes
