"""The prefix a prefill reuses, for every instance that prefills (prefill and aggregated alike): the
local prefix cache first, the pool after it, and the conductor told what the local cache holds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from halfmoon.engine.interface import LayerSink, RequestKV
from halfmoon.protocol import codecs
from halfmoon.protocol.pool import KVEvents, SnapshotRequest
from halfmoon.protocol.work import PrefillRequest
from halfmoon.runtime.pool_client import Fetched
from halfmoon.runtime.prefix_layers import PrefixLayers
from halfmoon.runtime.worker import EngineWorker
from halfmoon.telemetry.metrics import METRICS


class Prefix(NamedTuple):
    keys: list[bytes]  # of the request's full blocks (prompt and delivered output)
    local: int  # leading blocks in the local prefix cache
    fetched: Fetched  # the blocks after those that the pool had

    @property
    def reused(self) -> int:
        """Leading blocks the request does not compute."""
        return self.local + len(self.fetched.payloads)

    def kv(self, sink: LayerSink | None = None, sink_from_block: int = 0,
           export_prompt_from: int | None = None) -> RequestKV:
        """The request's KV: this prefix in (the pool's blocks after the local ones), and what goes out."""
        source = self.fetched.layers if self.fetched.layers is not None else self.fetched.payloads
        return RequestKV(source=source, start_block=self.local, sink=sink, sink_from_block=sink_from_block,
                         export_prompt_from=export_prompt_from)


class PrefixReuse:
    """One worker's prefix lookups and its reports of the local prefix cache (KVEvents)."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker

    @property
    def local_cache(self) -> bool:
        return self.worker.config.local_prefix_cache

    def block_keys(self, req: PrefillRequest) -> list[bytes]:
        """Keys of the full blocks of the prompt and the tokens a migrated request already produced."""
        assert self.worker.engine is not None
        return self.worker.engine.kv_spec.hasher(req.tenant_salt).keys(req.prompt_token_ids + req.output_token_ids)

    async def fetch(self, req: PrefillRequest) -> Prefix:
        """The request's block keys, and how much of its prefix is in the local cache and in the pool."""
        worker = self.worker
        assert worker.engine is not None
        size = worker.config.block_size
        keys = self.block_keys(req)
        if worker.engine.pool_kv:  # the engine reads the pool itself, under these keys
            return Prefix(keys, 0, Fetched([], [], None))
        context = len(req.prompt_token_ids) + len(req.output_token_ids)
        # The last token is always computed: its logits give the next output token.
        reusable = keys[: (context - 1) // size]
        # Local prefix cache first (it keys prompt blocks only); the pool supplies what follows it.
        prompt_blocks = reusable[: len(req.prompt_token_ids) // size]
        local = worker.engine.cached_prefix_blocks(prompt_blocks) if self.local_cache else 0
        fetched = await self.fetch_pooled(reusable[local:])
        METRICS.cache_hit_blocks.labels(worker.role.value).inc(local + len(fetched.payloads))
        METRICS.cache_miss_blocks.labels(worker.role.value).inc(len(reusable) - local - len(fetched.payloads))
        return Prefix(keys, local, fetched)

    async def fetch_pooled(self, keys: list[bytes]) -> Fetched:
        """The pool's part of the prefix: read layer by layer during the compute where its nodes move
        byte ranges (``layerwise_prefix``), else whole before it."""
        worker = self.worker
        found = await worker.pool.lookup(keys)
        if found is None:
            return Fetched([], [], None)
        first = [hit.replicas[0] for hit in found.hits]
        if not (first and worker.config.layerwise_prefix and await worker.pool.ranged(first)):
            return await worker.pool.read_prefix(found)
        layers = PrefixLayers(worker.pool.layout, first, worker.config.block_size, worker.transfer, worker.tracer,
                              worker.log, worker.pool.report_corrupt)
        layers.start()
        return Fetched(layers.payloads, first, found.lease_id, layers)

    def prompt_keys(self, req: PrefillRequest, keys: list[bytes]) -> list[bytes]:
        """The keys the engine caches the prompt's full blocks under (none without a local cache); an engine
        that moves its own KV (``pool_kv``) gets the whole context's, which it reads and writes the pool by."""
        assert self.worker.engine is not None
        if self.worker.engine.pool_kv:
            return keys
        return keys[: len(req.prompt_token_ids) // self.worker.config.block_size] if self.local_cache else []

    async def publish_cache_events(self, sample: tuple[int, int, float]) -> None:
        """Tell the conductor what the local prefix cache gained and lost, and how long prefill took."""
        worker = self.worker
        assert worker.engine is not None
        stored, evicted = await worker.engine.take_cache_events()
        await worker.publish(worker.subjects.kv_events, KVEvents(instance_id=worker.instance_id, stored=tuple(stored),
                                                                 evicted=tuple(evicted), prefill_samples=(sample,)))

    async def start(self) -> None:
        """Answer the conductor's snapshot requests, and send one now."""
        worker = self.worker
        await worker.listen(worker.subjects.kv_snapshot, codecs.KV_SNAPSHOT_REQUEST, self._on_snapshot_request)
        await self._on_snapshot_request(SnapshotRequest(), {})

    async def _on_snapshot_request(self, _request: SnapshotRequest, _headers: Mapping[str, str]) -> None:
        worker = self.worker
        assert worker.engine is not None
        held = await worker.engine.cached_block_keys()
        await worker.publish(worker.subjects.kv_events, KVEvents(instance_id=worker.instance_id, stored=tuple(held),
                                                                 snapshot=True))
