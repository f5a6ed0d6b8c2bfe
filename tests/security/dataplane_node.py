"""A real transfer node (DRAM segment + NVMe directory) behind a real socket, under a cluster secret
(a fixture module rather than conftest.py, which holds the control-plane fixtures)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from halfmoon.core.cluster_keys import ClusterKeys
from halfmoon.storage.dram import ShmTier
from halfmoon.storage.node import NodeStore
from halfmoon.storage.nvme import DirTier
from halfmoon.transfer.server import BlockServer

KEYS = ClusterKeys.from_secret(b"security-tests-cluster-secret-0123456789")
NODE = "transfer-sec"


@pytest.fixture
async def node(tmp_path) -> AsyncIterator[BlockServer]:
    store = NodeStore(ShmTier(8 << 20), DirTier(tmp_path / "nvme", 8 << 20))
    server = BlockServer(store, node_id=NODE, keys=KEYS, max_connections=4, idle_timeout_s=30)
    await server.start()
    yield server
    await server.stop()
    await store.close()
