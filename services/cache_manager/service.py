"""Cache-manager: the pool's metadata master. Knows every transfer node from its heartbeats and
rebuilds the block index from their inventories, so a restarted manager loses nothing."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from opentelemetry.trace import TracerProvider

from shared.kv.pool_index import PoolIndex
from shared.kv.pool_types import InventoryItem, NodeSpec, PoolConfig
from shared.protocol import codecs
from shared.protocol.registry import Heartbeat, InstanceDown, Load, Role
from shared.service.base import Service
from shared.service.config import ServiceConfig
from shared.storage.base import Tier
from shared.transfer.framing import Op, Request
from shared.transfer.tcp import TcpTransport


@dataclass(frozen=True)
class CacheManagerConfig(ServiceConfig):
    eviction: str = field(default="lru", metadata={"help": "eviction policy: lru, lfu or length"})
    replicas: int = field(default=1, metadata={"help": "replicas per stored block"})
    node_dram_bytes: int = field(default=1 << 30, metadata={"help": "DRAM a transfer node contributes"})

    def __post_init__(self) -> None:
        super().__post_init__()
        PoolConfig(eviction=self.eviction, replicas=self.replicas)  # validates


class CacheManagerService(Service[CacheManagerConfig]):
    role = Role.CACHE_MANAGER
    config_class = CacheManagerConfig

    def __init__(self, config: CacheManagerConfig, tracer_provider: TracerProvider | None = None) -> None:
        super().__init__(config, tracer_provider)
        self.index = PoolIndex(PoolConfig(eviction=config.eviction, replicas=config.replicas))
        self.nodes: dict[str, str] = {}

    def load(self) -> Load:
        return Load(running=self.index.stats().blocks)

    async def start(self) -> None:
        await self.listen(self.subjects.heartbeat, codecs.HEARTBEAT, self._on_heartbeat)
        await self.listen(self.subjects.down, codecs.DOWN, self._on_down)

    async def _on_heartbeat(self, beat: Heartbeat, _headers: Mapping[str, str]) -> None:
        if beat.role is not Role.TRANSFER or beat.instance_id in self.nodes or not beat.address:
            return
        self.nodes[beat.instance_id] = beat.address
        transport = TcpTransport(beat.address, pool_size=1)
        try:
            hello = await transport.request(Request(Op.HELLO))
            inventory = await transport.request(Request(Op.INVENTORY))
        except (OSError, ConnectionError) as exc:
            self.log.warning("transfer node unreachable", extra={"node": beat.instance_id, "error": str(exc)})
            del self.nodes[beat.instance_id]
            return
        finally:
            await transport.close()
        self.index.add_node(NodeSpec(beat.instance_id, beat.address, hello.segment,
                                     {Tier.DRAM: self.config.node_dram_bytes}))
        items = [InventoryItem(k, Tier(t), o, s)
                 for k, t, o, s in zip(inventory.keys, inventory.tiers, inventory.offsets, inventory.sizes)]
        refused = self.index.rebuild(beat.instance_id, items, time.time())
        self.log.info("transfer node joined", extra={"node": beat.instance_id, "blocks": len(items) - len(refused)})

    async def _on_down(self, down: InstanceDown, _headers: Mapping[str, str]) -> None:
        if self.nodes.pop(down.instance_id, None) is not None:
            lost = self.index.remove_node(down.instance_id, time.time())
            self.log.info("transfer node left", extra={"node": down.instance_id, "lost_blocks": len(lost)})
