"""Transfer node: this node's slice of the KVCache pool (DRAM segment, NVMe directory, S3 prefix)
served to peers over TCP and, for same-host clients, straight from shared memory."""

from __future__ import annotations

from dataclasses import dataclass, field

from halfmoon.kv.pool_wire import order_from_wire
from halfmoon.protocol import codecs
from halfmoon.protocol.pool import OrderBatch, OrderResults
from halfmoon.protocol.registry import Load, Role
from halfmoon.service.base import Service
from halfmoon.service.config import ServiceConfig
from halfmoon.storage.base import TierUnavailable
from halfmoon.storage.dram import ShmTier
from halfmoon.storage.node import NodeStore
from halfmoon.storage.nvme import DirTier
from halfmoon.storage.s3 import S3Config, S3Tier
from halfmoon.telemetry.metrics import METRICS
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.orders import execute
from halfmoon.transfer.server import BlockServer
from opentelemetry.trace import TracerProvider


@dataclass(frozen=True)
class TransferConfig(ServiceConfig):
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

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dram_bytes < 1 << 20:
            raise ValueError(f"dram_bytes must be at least 1 MiB, got {self.dram_bytes}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")


class TransferService(Service[TransferConfig]):
    role = Role.TRANSFER
    config_class = TransferConfig

    def __init__(self, config: TransferConfig, tracer_provider: TracerProvider | None = None) -> None:
        super().__init__(config, tracer_provider)
        self.store: NodeStore | None = None
        self.server: BlockServer | None = None
        self.peers = TransferClient(same_host=False)

    @property
    def address(self) -> str:
        if self.server is None:
            return ""
        port = self.server.address.rsplit(":", 1)[1]
        return f"{self.config.advertise_host or self.config.host}:{port}"

    def load(self) -> Load:
        return Load()

    async def start(self) -> None:
        cfg = self.config
        nvme = DirTier(cfg.nvme_dir, cfg.nvme_bytes) if cfg.nvme_dir else None
        s3 = None
        if cfg.s3_endpoint:
            s3 = S3Tier(S3Config(endpoint_url=cfg.s3_endpoint, bucket=cfg.s3_bucket, prefix=cfg.s3_prefix,
                                 access_key=cfg.s3_access_key, secret_key=cfg.s3_secret_key))
            try:
                await s3.ensure_bucket()
            except TierUnavailable as exc:  # the pool still serves from DRAM and NVMe
                self.log.warning("S3 tier unavailable at start", extra={"error": str(exc)})
        self.store = NodeStore(ShmTier(cfg.dram_bytes), nvme, s3)
        self.server = BlockServer(self.store, cfg.host, cfg.port)
        await self.server.start()
        await self.serve(self.subjects.transfer_orders(self.instance_id), codecs.ORDER_BATCH, self._on_orders,
                         span_name="transfer.orders")
        self.log.info("serving blocks", extra={"address": self.address})

    async def _on_orders(self, batch: OrderBatch) -> OrderResults:
        assert self.store is not None
        ok = [await execute(order_from_wire(order), self.store, self.peers, batch.addresses.__getitem__)
              for order in batch.orders]
        METRICS.errors.labels("order_failed").inc(ok.count(False))
        return OrderResults(ok=tuple(ok), unavailable_tiers=tuple(int(t) for t in self.store.unavailable))

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop()
        await self.peers.close()
        if self.store is not None:
            await self.store.close()
