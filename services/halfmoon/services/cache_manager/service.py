"""Cache-manager: the KVCache pool's metadata master (Mooncake Store's master).

It knows every transfer node from its heartbeats and rebuilds the block index from their
inventories (so a restarted manager loses nothing), answers put_start / put_end / lookup /
release / remove / stats over NATS, and runs housekeeping: revoking puts that never ended,
expiring leases, and sending tiering orders (demote, promote, replicate, free) to the nodes.

Several may run: one is active (it holds the ``cache-manager`` lease, service/leadership.py),
the others are hot standbys that know the nodes and serve nothing. When the active one is gone,
its lease lapses within ``leadership_ttl_s`` and a standby takes over: it rebuilds the index from
the nodes' inventories, then answers and sends orders. One writer at a time, because two would
place blocks on the same free extents.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import nats.errors
from nats.aio.subscription import Subscription
from opentelemetry.trace import TracerProvider

from halfmoon.core.tiers import Tier
from halfmoon.kv.pool_index import PoolIndex
from halfmoon.kv.pool_types import (
    InventoryItem,
    NodeSpec,
    Order,
    OrderKind,
    PoolConfig,
    Replica,
)
from halfmoon.kv.pool_wire import executing_node, stats_reply
from halfmoon.policy.eviction import Watermarks
from halfmoon.protocol import codecs
from halfmoon.protocol.base import Codec, ErrorCode, ErrorReply, RemoteError
from halfmoon.protocol.cache import (
    BlockReplicas,
    CacheAck,
    CorruptBlocks,
    Lookup,
    LookupResult,
    PutEnd,
    PutPlan,
    PutStart,
    Release,
)
from halfmoon.protocol.permissions import leadership_bucket
from halfmoon.protocol.pool import (
    OrderBatch,
    PoolStatsReply,
    RemoveRequest,
    StatsRequest,
)
from halfmoon.protocol.registry import Heartbeat, InstanceDown, Load, Role
from halfmoon.protocol.work import BlockLocation
from halfmoon.runtime.base import Service
from halfmoon.runtime.config import ServiceConfig
from halfmoon.runtime.leadership import Leadership
from halfmoon.runtime.rpc import RequestHandler
from halfmoon.services.cache_manager.grants import READ, WRITE, Grants
from halfmoon.telemetry.metrics import METRICS, Metrics
from halfmoon.transfer.capability import Right
from halfmoon.transfer.framing import Op, Request
from halfmoon.transfer.tcp import TcpTransport
from halfmoon.transfer.transport import TransferError

Req = TypeVar("Req")

ORDER_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class CacheManagerConfig(ServiceConfig):
    eviction: str = field(default="lru", metadata={"help": "eviction policy: lru, lfu or length"})
    replicas: int = field(default=1, metadata={"help": "replicas per stored block"})
    high_watermark: float = field(default=0.9, metadata={"help": "tier fill that starts eviction/demotion"})
    low_watermark: float = field(default=0.7, metadata={"help": "tier fill eviction/demotion stops at"})
    put_timeout_s: float = field(default=30.0, metadata={"help": "revoke a put not ended within this"})
    lease_ttl_s: float = field(default=10.0, metadata={"help": "how long a lookup protects its blocks"})
    hot_reads_per_s: float = field(default=50.0, metadata={"help": "read rate that earns extra DRAM replicas"})
    max_hot_replicas: int = field(default=3, metadata={"help": "most DRAM replicas of a hot block"})
    housekeeping_interval_s: float = field(default=0.25, metadata={"help": "seconds between housekeeping rounds"})
    capability_ttl_s: float = field(default=300.0, metadata={
        "help": "lifetime of the read/write capabilities in put_start and lookup answers"})
    tenant_quota_bytes: int = field(default=0, metadata={
        "help": "pool bytes each tenant may hold (0: no quota; requests without a tenant are never limited)"})
    tenant_quotas: str = field(default="", metadata={"help": "per-tenant quotas overriding it: name=bytes,..."})
    leadership_ttl_s: float = field(default=3.0, metadata={
        "help": "lease of the active cache-manager: a standby takes over within about this once it is gone"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pool_config()  # validates
        if self.capability_ttl_s <= 0:
            raise ValueError(f"capability_ttl_s must be > 0, got {self.capability_ttl_s}")
        if self.leadership_ttl_s <= 0:
            raise ValueError(f"leadership_ttl_s must be > 0, got {self.leadership_ttl_s}")

    def quotas(self) -> dict[str, int]:
        out = {}
        for item in filter(None, (part.strip() for part in self.tenant_quotas.split(","))):
            name, sep, size = item.partition("=")
            if not sep or not name or not size.strip().isdigit():
                raise ValueError(f"tenant_quotas entries are name=bytes, got {item!r}")
            out[name.strip()] = int(size)
        return out

    def pool_config(self) -> PoolConfig:
        return PoolConfig(eviction=self.eviction, replicas=self.replicas,
                          watermarks=Watermarks(high=self.high_watermark, low=self.low_watermark),
                          put_timeout_s=self.put_timeout_s, lease_ttl_s=self.lease_ttl_s,
                          hot_reads_per_s=self.hot_reads_per_s, max_hot_replicas=self.max_hot_replicas,
                          tenant_quota_bytes=self.tenant_quota_bytes, tenant_quotas=self.quotas())


class NodeInfo(NamedTuple):
    address: str
    segment: str
    incarnation: str = ""  # the run of the node process its heartbeats named when it joined


class CacheManagerService(Service[CacheManagerConfig]):
    role = Role.CACHE_MANAGER
    config_class = CacheManagerConfig

    def __init__(self, config: CacheManagerConfig, tracer_provider: TracerProvider | None = None) -> None:
        super().__init__(config, tracer_provider)
        self.index = PoolIndex(config.pool_config())
        self.grants = Grants(self.cluster_keys.grant, config.capability_ttl_s)
        self.nodes: dict[str, NodeInfo] = {}
        self._joining: set[str] = set()
        self._orders: list[Order] = []
        self._housekeeping: asyncio.Task[None] | None = None
        self._leading: asyncio.Task[None] | None = None
        self._served: list[Subscription] = []  # the pool's subjects, while this instance is the active one
        self.leadership: Leadership | None = None
        self._unscrape: Callable[[], None] = lambda: None

    def load(self) -> Load:
        stats = self.index.stats()
        return Load(running=stats.blocks, queue_len=stats.orders_in_flight)

    async def start(self) -> None:
        await self.listen_heartbeats(self._on_heartbeat)
        await self.listen_downs(self._on_down)
        self.leadership = Leadership(self.nc.jetstream(), leadership_bucket(self.subjects), self.role.value,
                                     self.instance_id, self.config.leadership_ttl_s)
        if await self.leadership.try_acquire():
            await self._take_over()
        else:
            self.log.info("standby: another cache-manager is active")
        self._leading = asyncio.create_task(self._lead_forever())
        self._unscrape = METRICS.on_scrape(self._record_pool)

    @property
    def active(self) -> bool:
        return bool(self._served)

    async def _lead_forever(self) -> None:
        assert self.leadership is not None
        while True:
            await asyncio.sleep(self.leadership.period_s)
            try:
                if self.active:
                    await self.leadership.renew()
                elif await self.leadership.try_acquire():
                    await self._take_over()
            except (nats.errors.Error, TimeoutError) as exc:  # NATS away: a lease not renewed lapses by itself
                self.log.warning("leadership not renewed", extra={"error": repr(exc)})
            if self.active and not self.leadership.held:
                await self._step_down()

    async def _take_over(self) -> None:
        """Become the active cache-manager: an index from the nodes' inventories, then the pool's subjects."""
        if self.nodes:  # a standby's index is as old as its joins: every node joins again on its next heartbeat
            self.index, self.nodes = PoolIndex(self.config.pool_config()), {}
        cache, queue = self.subjects.cache, self.role.value  # NOTE: a queue group: never two answers to one request

        async def serve(op: str, codec: Codec[Req], handler: RequestHandler[Req]) -> Subscription:
            return await self.serve(cache(op), codec, handler, span_name=f"cache.{op}", queue=queue)

        self._served = [await serve("put_start", codecs.CACHE_PUT_START, self._put_start),
                        await serve("put_end", codecs.CACHE_PUT_END, self._put_end),
                        await serve("lookup", codecs.CACHE_LOOKUP, self._lookup),
                        await serve("release", codecs.CACHE_RELEASE, self._release),
                        await serve("remove", codecs.CACHE_REMOVE, self._remove),
                        await serve("corrupt", codecs.CACHE_CORRUPT, self._corrupt),
                        await serve("stats", codecs.CACHE_STATS_REQUEST, self._stats)]
        self._housekeeping = asyncio.create_task(self._housekeep_forever())
        self.log.info("active: serving the pool")

    async def _step_down(self) -> None:
        for sub in self._served:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._served = []
        if self._housekeeping is not None:
            self._housekeeping.cancel()
        self.log.warning("lease lost: standby now")

    def _record_pool(self, metrics: Metrics) -> None:
        metrics.pool_bytes.clear()  # nodes that left
        for tier in self.index.stats().tiers:
            metrics.pool_bytes.labels(tier.node, tier.tier.name.lower()).set(tier.used)

    async def close(self) -> None:
        self._unscrape()
        for task in (self._housekeeping, self._leading):
            if task is not None:
                task.cancel()
        if self.leadership is not None:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await self.leadership.release()  # a standby takes over now, not after the lease lapses

    # ------------------------------------------------------------------ membership
    async def _on_heartbeat(self, beat: Heartbeat, _headers: Mapping[str, str]) -> None:
        node = beat.instance_id
        if beat.role is not Role.TRANSFER or not beat.address or node in self._joining:
            return
        known = self.nodes.get(node)
        if known is not None and (known.address, known.incarnation) == (beat.address, beat.incarnation):
            return
        self._joining.add(node)
        transport = TcpTransport(beat.address, pool_size=1, keys=self.cluster_keys)
        try:
            hello = await transport.request(Request(Op.HELLO))
            inventory = await transport.request(Request(Op.INVENTORY, caps=[self.grants.inventory(node)]))
            if not inventory.ok:
                raise TransferError(f"inventory refused: {inventory.error}")
        except (TransferError, OSError) as exc:
            self.log.warning("transfer node unreachable", extra={"node": node, "error": str(exc)})
            return
        finally:
            self._joining.discard(node)
            await transport.close()
        if node in self.nodes:
            # NOTE: a restarted node (new run, port or segment): what the index holds for it is the dead run's,
            # so it goes, and the blocks come back from the inventory the new run just reported
            lost = self.index.remove_node(node, time.time())
            self.log.info("transfer node restarted", extra={"node": node, "lost_blocks": len(lost)})
        capacity = {Tier(t): c for t, c in enumerate(hello.capacities) if c > 0} or {Tier.DRAM: 1 << 30}
        self.index.add_node(NodeSpec(node, beat.address, hello.segment, capacity))
        self.nodes[node] = NodeInfo(beat.address, hello.segment, beat.incarnation)
        items = [InventoryItem(k, Tier(t), o, s)
                 for k, t, o, s in zip(inventory.keys, inventory.tiers, inventory.offsets, inventory.sizes)]
        refused = self.index.rebuild(node, items, time.time())
        self.log.info("transfer node joined", extra={"node": node, "blocks": len(items) - len(refused),
                                                      "tiers": [t.name for t in capacity]})

    async def _on_down(self, down: InstanceDown, _headers: Mapping[str, str]) -> None:
        known = self.nodes.get(down.instance_id)
        if known is not None and down.incarnation and known.incarnation not in ("", down.incarnation):
            return  # about the run before a restart: the run that joined since is live
        if self.nodes.pop(down.instance_id, None) is not None:
            lost = self.index.remove_node(down.instance_id, time.time())
            self.log.info("transfer node left", extra={"node": down.instance_id, "lost_blocks": len(lost)})

    def _location(self, key: bytes, replica: Replica, rights: Right) -> BlockLocation:
        info = self.nodes[replica.node]
        return self.grants.location(key, replica, info.address, info.segment, rights)

    # -------------------------------------------------------------------- protocol
    async def _put_start(self, req: PutStart) -> PutPlan:
        if self.leadership is None or not self.leadership.held:  # a lapsed lease: another may be placing now
            raise RemoteError(ErrorReply(code=ErrorCode.UNAVAILABLE, message=f"{self.instance_id} is not active"))
        try:
            placements = self.index.put_start(req.keys, req.sizes, time.time(), req.first_position, req.tenant)
        except ValueError as exc:
            raise RemoteError(ErrorReply(code=ErrorCode.BAD_REQUEST, message=str(exc))) from None
        existing = [p.key for p in placements if p.exists]
        return PutPlan(
            placements=tuple(self._location(p.key, r, WRITE) for p in placements if not p.exists for r in p.replicas),
            existing=tuple(existing),
            expires=time.time() + self.config.put_timeout_s,
            existing_replicas=tuple(self._location(key, replica, READ)
                                    for key, replica in self.index.locate(existing)),
        )

    async def _put_end(self, req: PutEnd) -> CacheAck:
        self.index.put_end(req.keys, time.time())
        return CacheAck(count=len(req.keys))

    async def _lookup(self, req: Lookup) -> LookupResult:
        found = self.index.lookup(req.keys, time.time())
        METRICS.cache_hit_blocks.labels(self.role.value).inc(len(found.hits))
        METRICS.cache_miss_blocks.labels(self.role.value).inc(len(req.keys) - len(found.hits))
        hits = tuple(BlockReplicas(key=key, replicas=tuple(self._location(key, r, READ) for r in replicas))
                     for key, replicas in zip(req.keys, found.hits))
        if found.lease is None:
            return LookupResult(hits=hits)
        return LookupResult(hits=hits, lease_id=str(found.lease.lease_id), lease_expires=found.lease.expires_at)

    async def _release(self, req: Release) -> CacheAck:
        return CacheAck(count=int(req.lease_id.isdigit() and self.index.release(int(req.lease_id))))

    async def _remove(self, req: RemoveRequest) -> CacheAck:
        orders = self.index.remove(req.keys)
        self._orders.extend(orders)
        return CacheAck(count=len({o.key for o in orders}))

    async def _corrupt(self, req: CorruptBlocks) -> CacheAck:
        node_at = {info.address: node for node, info in self.nodes.items()}
        orders = [order for loc in req.blocks if loc.key is not None and loc.address in node_at
                  for order in self.index.remove_replica(loc.key, node_at[loc.address], loc.tier, loc.offset)]
        self._orders.extend(orders)
        dropped = len(orders)
        METRICS.pool_corrupt_blocks.inc(dropped)
        if dropped:
            self.log.warning("corrupt blocks dropped from the pool", extra={"reporter": req.reporter,
                                                                           "blocks": dropped})
        return CacheAck(count=dropped)

    async def _stats(self, _req: StatsRequest) -> PoolStatsReply:
        return stats_reply(self.index.stats())

    # ----------------------------------------------------------------- housekeeping
    async def _housekeep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.housekeeping_interval_s)
            now = time.time()
            orders, self._orders = self._orders + self.index.expire(now) + self.index.plan(now), []
            if orders:
                await self._dispatch(orders)

    async def _dispatch(self, orders: list[Order]) -> None:
        by_node: dict[str, list[Order]] = defaultdict(list)
        for order in orders:
            by_node[executing_node(order)].append(order)
        addresses = {node: info.address for node, info in self.nodes.items()}
        results = await asyncio.gather(*[self._send(node, batch, addresses) for node, batch in by_node.items()])
        now = time.time()
        for batch, outcome in zip(by_node.values(), results):
            for order, ok in zip(batch, outcome):
                if order.kind is not OrderKind.FREE:
                    self._orders.extend(self.index.order_done(order.order_id, ok, now))

    async def _send(self, node: str, batch: list[Order], addresses: dict[str, str]) -> tuple[bool, ...]:
        if node not in self.nodes:
            return (False,) * len(batch)
        try:
            reply = await self.request(self.subjects.transfer_orders(node),
                                       OrderBatch(orders=tuple(self.grants.order(o) for o in batch),
                                                  addresses=addresses),
                                       codecs.ORDER_RESULTS, ORDER_TIMEOUT_S)
        except RemoteError as exc:
            self.log.warning("orders not delivered", extra={"node": node, "error": str(exc)})
            return (False,) * len(batch)
        self._note_tiers(node, {Tier(t) for t in reply.unavailable_tiers})
        return reply.ok

    def _note_tiers(self, node: str, unavailable: set[Tier]) -> None:
        before = {t.tier for t in self.index.stats().tiers if t.node == node and not t.available}
        for tier in Tier:
            self.index.set_tier_available(node, tier, tier not in unavailable)
        for tier in unavailable - before:
            self.log.warning("tier unavailable: serving from the others", extra={"node": node, "tier": tier.name})
        for tier in before - unavailable:
            self.log.info("tier available again", extra={"node": node, "tier": tier.name})
