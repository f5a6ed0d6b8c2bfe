"""KV integrity against tampering, and tenant quotas of pool space."""

from __future__ import annotations

import hashlib
import mmap
import os

import torch

from halfmoon.core.block_format import BlockLayout, encode_block, verify_block, verify_layer
from halfmoon.core.cluster_keys import DEV_KEYS
from halfmoon.core.tiers import Tier
from halfmoon.kv.pool_index import PoolIndex
from halfmoon.kv.pool_types import NodeSpec, PoolConfig
from halfmoon.transfer.server import BlockServer
from halfmoon.transfer.tcp import TcpTransport
from tests.fixtures.dataplane import caps
from tests.security.dataplane_node import KEYS, NODE, node  # noqa: F401  (fixture)

LAYOUT = BlockLayout(hashlib.sha256(b"model").digest(), torch.float16, 4, 2, 8, KEYS.kv_mac)


def key(i: int) -> bytes:
    return hashlib.sha256(f"integrity-{i}".encode()).digest()


def kv(seed: int) -> torch.Tensor:
    return torch.randn(4, 2, 16, 2, 8, generator=torch.Generator().manual_seed(seed))


async def stored(node: BlockServer, k: bytes, tier: Tier) -> tuple[TcpTransport, bytes]:
    tcp = TcpTransport(node.address, keys=KEYS)
    block = encode_block(LAYOUT, kv(1), k)
    await tcp.write([k], [block], caps=caps([k], node=NODE, keys=KEYS), tier=tier)
    return tcp, bytes(block)


async def read_back(tcp: TcpTransport, k: bytes) -> memoryview:
    (view,) = await tcp.read([k], caps=caps([k], node=NODE, keys=KEYS))
    return view


class TestBlocksRewrittenInPlace:
    async def test_a_dram_block_rewritten_without_the_mac_key_fails_verification(self, node: BlockServer) -> None:
        tcp, block = await stored(node, key(1), Tier.DRAM)
        assert verify_block(LAYOUT, await read_back(tcp, key(1)), key(1))
        forged = encode_block(LAYOUT._replace(mac_key=DEV_KEYS.kv_mac), kv(2), key(1))  # well-formed, wrong key
        offset = node.store.dram.locate(key(1)).offset
        fd = os.open(f"/dev/shm/{node.store.dram.segment.lstrip('/')}", os.O_RDWR)  # as a same-host mapper
        with mmap.mmap(fd, 0) as shm:
            shm[offset : offset + len(forged)] = forged
        os.close(fd)
        tampered = await read_back(tcp, key(1))
        assert bytes(tampered) == bytes(forged) != block  # the node serves what is there...
        assert not verify_block(LAYOUT, tampered, key(1))  # ...and the reader refuses to use it
        assert not any(verify_layer(LAYOUT, tampered, layer, key(1)) for layer in range(LAYOUT.num_layers))
        await tcp.close()

    async def test_an_nvme_file_rewritten_or_swapped_fails_verification(self, node: BlockServer) -> None:
        tcp, block = await stored(node, key(1), Tier.NVME)
        _, other = await stored(node, key(2), Tier.NVME)
        path = node.store.tiers[Tier.NVME]._path(key(1))  # type: ignore[attr-defined]
        one_layer = bytearray(block)
        one_layer[-3] ^= 0x01  # one bit of the last layer
        path.write_bytes(one_layer)
        tampered = await read_back(tcp, key(1))
        assert not verify_block(LAYOUT, tampered, key(1))
        assert verify_layer(LAYOUT, tampered, 0, key(1)) and not verify_layer(LAYOUT, tampered, 3, key(1))
        path.write_bytes(other)  # a valid block, sealed for another key: a replay
        assert not verify_block(LAYOUT, await read_back(tcp, key(1)), key(1))
        assert verify_block(LAYOUT, await read_back(tcp, key(2)), key(2))
        await tcp.close()


class TestTenantQuotas:
    def test_a_tenant_over_quota_caches_nothing_more_while_others_still_cache(self) -> None:
        block = 1 << 10
        index = PoolIndex(PoolConfig(tenant_quota_bytes=4 * block, tenant_quotas={"big": 100 * block}))
        index.add_node(NodeSpec("n", "127.0.0.1:1", "seg", {Tier.DRAM: 1 << 20}))
        keys = [key(i) for i in range(40)]
        first = index.put_start(keys[:6], [block] * 6, now=0, tenant="a")
        assert [bool(p.replicas) for p in first] == [True] * 4 + [False] * 2  # the last two: refused, not cached
        index.put_end(keys[:4], now=0)
        assert not any(p.replicas or p.exists for p in index.put_start(keys[6:8], [block] * 2, now=1, tenant="a"))
        assert all(p.replicas for p in index.put_start(keys[8:12], [block] * 4, now=1, tenant="b"))
        assert all(p.replicas for p in index.put_start(keys[12:22], [block] * 10, now=1, tenant="big"))
        assert all(p.replicas for p in index.put_start(keys[22:32], [block] * 10, now=1))  # no tenant: no quota
        assert index.tenant_usage("a") == 4 * block
        index.remove(keys[:2])  # a's blocks leave the pool: its room comes back
        assert index.tenant_usage("a") == 2 * block
        assert all(p.replicas for p in index.put_start(keys[32:34], [block] * 2, now=2, tenant="a"))
