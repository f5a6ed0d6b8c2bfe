"""Transfer node: this node's slice of the KVCache pool (DRAM segment, NVMe directory, S3 prefix)
served to peers over TCP, for same-host clients straight from shared memory, and one-sided over
RDMA or Mooncake's transfer engine where ``data_paths`` names them."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry.trace import TracerProvider

from halfmoon.kv.pool_wire import order_from_wire
from halfmoon.protocol import codecs
from halfmoon.protocol.pool import OrderBatch, OrderResults
from halfmoon.protocol.registry import Load, Role
from halfmoon.runtime.base import Service
from halfmoon.runtime.config import require_for, setting
from halfmoon.runtime.data_plane import DataPlaneConfig, OneSidedEndpoints
from halfmoon.runtime.memory import MemoryReport, service_report
from halfmoon.storage.base import TierUnavailable
from halfmoon.storage.dram import ShmTier
from halfmoon.storage.node import NodeStore
from halfmoon.storage.nvme import DirTier
from halfmoon.storage.s3 import S3Config, S3Tier
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.orders import authorized, execute
from halfmoon.transfer.server import BlockServer


@dataclass(frozen=True)
class TransferConfig(DataPlaneConfig):
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on for block reads/writes"})
    advertise_host: str = field(default="", metadata={"help": "address peers use (default: --host)"})
    port: int = field(default=0, metadata={"help": "TCP port (0: any free port)"})
    dram_bytes: int = field(default=1 << 30, metadata={"help": "size of the shared-memory DRAM segment"})
    nvme_dir: str = field(default="", metadata={"help": "directory of the NVMe tier (empty: no NVMe tier)"})
    nvme_bytes: int = field(default=8 << 30, metadata={"help": "capacity of the NVMe tier"})
    s3_endpoint: str = field(default="", metadata={"help": "S3-compatible endpoint URL (empty: no S3 tier)"})
    s3_bucket: str = field(default="halfmoon-kv", metadata={"help": "S3 bucket of the object tier"})
    s3_prefix: str = field(default="kv/", metadata={"help": "key prefix inside the bucket"})
    s3_access_key: str = field(default="halfmoon", metadata={"help": "S3 access key"})
    s3_secret_key: str = field(default="halfmoon", metadata={"help": "S3 secret key"})
    max_connections: int = field(default=256, metadata={"help": "concurrent data-plane connections; more are refused"})
    idle_timeout_s: float = field(default=300.0, metadata={"help": "close a data-plane connection idle this long"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dram_bytes < 1 << 20:
            raise ValueError(f"dram_bytes must be at least 1 MiB, got {self.dram_bytes}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_connections < 1 or self.idle_timeout_s <= 0:
            raise ValueError("max_connections must be >= 1 and idle_timeout_s > 0")
        require_for(self, ["nvme_bytes"], bool(self.nvme_dir), f"{setting('nvme_dir')}, the NVMe tier")
        require_for(self, ["s3_bucket", "s3_prefix", "s3_access_key", "s3_secret_key"], bool(self.s3_endpoint),
                    f"{setting('s3_endpoint')}, the S3 tier")
        if self.s3_endpoint:
            if not (self.s3_access_key and self.s3_secret_key):
                raise ValueError(f"the S3 tier needs {setting('s3_access_key')} and {setting('s3_secret_key')}")
            self.s3_config()  # validates the endpoint, bucket and prefix now, not when the node starts

    def s3_config(self) -> S3Config:
        return S3Config(endpoint_url=self.s3_endpoint, bucket=self.s3_bucket, prefix=self.s3_prefix,
                        access_key=self.s3_access_key, secret_key=self.s3_secret_key)


class TransferService(Service[TransferConfig]):
    role = Role.TRANSFER
    config_class = TransferConfig

    def __init__(self, config: TransferConfig, tracer_provider: TracerProvider | None = None) -> None:
        super().__init__(config, tracer_provider)
        self.store: NodeStore | None = None
        self.server: BlockServer | None = None
        self.endpoints: OneSidedEndpoints | None = None
        self.peers: TransferClient | None = None  # to other nodes, for copy orders

    @property
    def address(self) -> str:
        if self.server is None:
            return ""
        port = self.server.address.rsplit(":", 1)[1]
        return f"{self.config.advertise_host or self.config.host}:{port}"

    def load(self) -> Load:
        return Load()

    def memory_report(self) -> MemoryReport:
        """Its DRAM segment is resident once written; the NVMe tier is files (page cache, not RSS)."""
        cfg = self.config
        return service_report(self.role.value, {"DRAM segment": cfg.dram_bytes}, segment_bytes=cfg.dram_bytes,
                              pool_bytes=cfg.dram_bytes + (cfg.nvme_bytes if cfg.nvme_dir else 0))

    async def start(self) -> None:
        cfg = self.config
        nvme = DirTier(cfg.nvme_dir, cfg.nvme_bytes) if cfg.nvme_dir else None
        s3 = None
        if cfg.s3_endpoint:
            s3 = S3Tier(cfg.s3_config())
            try:
                await s3.ensure_bucket()
            except TierUnavailable as exc:  # the pool still serves from DRAM and NVMe
                self.log.warning("S3 tier unavailable at start", extra={"error": str(exc)})
        self.store = NodeStore(ShmTier(cfg.dram_bytes), nvme, s3)
        self.endpoints = OneSidedEndpoints(cfg, cfg.advertise_host or cfg.host)
        offered = self.endpoints.offer(self.store.dram.segment_view)
        self.peers = self.endpoints.client(self.cluster_keys, same_host=False)
        self.server = BlockServer(self.store, cfg.host, cfg.port, node_id=self.instance_id, keys=self.cluster_keys,
                                  max_connections=cfg.max_connections, idle_timeout_s=cfg.idle_timeout_s,
                                  offers=offered.offers, accept=offered.accept)
        await self.server.start()
        await self.serve(self.subjects.transfer_orders(self.instance_id), codecs.ORDER_BATCH, self._on_orders,
                         span_name="transfer.orders")
        self.log.info("serving blocks", extra={"address": self.address})

    async def _on_orders(self, batch: OrderBatch) -> OrderResults:
        assert self.store is not None and self.server is not None and self.peers is not None
        ok = []
        for wire in batch.orders:
            order = order_from_wire(wire)
            ok.append(authorized(wire, order, self.server.checker) and await execute(
                order, self.store, self.peers, batch.addresses.__getitem__, wire.source_capability))
        METRICS.errors.labels("order_failed").inc(ok.count(False))
        return OrderResults(ok=tuple(ok), unavailable_tiers=tuple(int(t) for t in self.store.unavailable))

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop()
        if self.peers is not None:
            await self.peers.close()
        if self.endpoints is not None:
            self.endpoints.close()
        if self.store is not None:
            await self.store.close()
