"""State shared by the pool index's protocol operations and its tiering planner."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from halfmoon.kv.pool_nodes import NodeLedger
from halfmoon.kv.pool_types import Order, OrderKind, PoolConfig, Replica, Tier


@dataclass(slots=True)  # one per indexed block: no per-instance dict
class Block:
    replicas: list[Replica]
    visible: bool
    deadline: float  # put_end must come before this (pending puts only)
    position: int  # index in its prefix chain, for length-aware eviction
    leases: int = 0
    busy: int = 0  # orders in flight that read or move this block
    heat: float = 0.0  # decayed read count, see ``read_rate``
    heat_at: float = 0.0
    tenant: str = ""  # whose quota pays for it (the first writer's)
    charged: int = 0  # bytes charged to that quota

    def read_rate(self, now: float, window: float) -> float:
        """Reads per second, exponentially averaged over ``window`` seconds."""
        return self.heat * math.exp(-max(0.0, now - self.heat_at) / window) / window

    def in_dram(self) -> list[Replica]:
        return [r for r in self.replicas if r.tier is Tier.DRAM]


@dataclass
class PoolState:
    config: PoolConfig
    nodes: dict[str, NodeLedger] = field(default_factory=dict)
    blocks: dict[bytes, Block] = field(default_factory=dict)
    # insertion-ordered (dicts as ordered sets) so replays in the simulator are deterministic
    want_promote: dict[bytes, None] = field(default_factory=dict)
    want_hot: dict[bytes, None] = field(default_factory=dict)
    tenant_used: dict[str, int] = field(default_factory=dict)  # bytes of blocks each tenant wrote
    _next_id: int = 0

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def protected(self, key: bytes) -> bool:
        """Not an eviction candidate: unknown, still being written, leased or being moved."""
        block = self.blocks.get(key)
        return block is None or not block.visible or block.leases > 0 or block.busy > 0

    def add_replica(self, key: bytes, block: Block, replica: Replica, now: float) -> None:
        block.replicas.append(replica)
        if block.visible:
            self.nodes[replica.node].track(replica, key, now, block.position)

    def drop_replica(self, key: bytes, block: Block, replica: Replica) -> Order:
        """Forget one replica (and the block with its last one); the node must free the bytes."""
        block.replicas.remove(replica)
        ledger = self.nodes[replica.node]
        if block.visible:
            ledger.untrack(replica, key)
        ledger.release(replica)
        if not block.replicas:
            self.forget(key)
        return Order(self.new_id(), OrderKind.FREE, key, replica, None)

    def drop_block(self, key: bytes) -> list[Order]:
        block = self.blocks[key]
        return [self.drop_replica(key, block, r) for r in list(block.replicas)]

    def forget(self, key: bytes) -> None:
        block = self.blocks.pop(key)
        if block.charged:
            self.tenant_used[block.tenant] -= block.charged
        self.want_promote.pop(key, None)
        self.want_hot.pop(key, None)
