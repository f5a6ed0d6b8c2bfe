"""Halfmoon's KV pool behind vLLM's v1 KV connector interface: any vLLM server shares the pool's blocks.

Run a pool (``halfmoon up --pool-only``) and start vLLM with::

    python -m vllm.entrypoints.openai.api_server --model DIR --kv-transfer-config '{"kv_connector":
      "HalfmoonConnector", "kv_connector_module_path": "halfmoon.connectors.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"nats_url": "nats://..."}}'

The connection settings are the services' own (HALFMOON_NATS_URL, HALFMOON_NAMESPACE,
HALFMOON_NATS_USER/PASSWORD as the ``kv-client`` user, HALFMOON_CLUSTER_SECRET[_FILE], TLS), each of which
``kv_connector_extra_config`` may override under the field's name; ``block_size`` (default 16, Halfmoon's)
and ``cache_salt`` (the salt of the tenant this server serves, as Halfmoon's gateway derives it; a request's
own ``cache_salt`` narrows within it, as at the gateway) are the pool's.

One pool, one format: blocks are keyed by Halfmoon's chained keys (model fingerprint of the same model
directory and dtype, block size, tenant salt) and laid out as Halfmoon's engine lays them out
(core/block_format.py), so a prefix either engine stored is a prefix the other loads. vLLM's own block
size need not match the pool's: blocks move by token position.

vLLM loads this class in its scheduler process and in its worker; each builds the side of its role. Scheduler
side (connectors/vllm_scheduler.py): ``get_num_new_matched_tokens`` looks the prompt's full blocks up (leased
until the request finishes) and says how many tokens the pool holds beyond vLLM's own cache. Worker side
(connectors/vllm_worker.py): the reads start with the step. Where the blocks sit in the DRAM of nodes this
process reaches by byte ranges (shared memory, RDMA), they are read layer by layer (runtime/prefix_layers.py:
a ``pool.layer_read`` span per layer, each layer's MAC verified as it lands), and vLLM's layer ``l`` waits for
layer ``l`` only, so the reads of later layers overlap its compute (a ``vllm.layer_forward`` span per layer,
in the request's trace); elsewhere they are read whole before the first layer. Each layer is copied into
vLLM's paged cache just before that layer's attention; a block that is missing or fails its MAC is reported
through ``get_block_ids_with_load_errors``, and vLLM recomputes from there
(``kv_load_failure_policy: recompute``). Every block that a step completes is copied out layer by layer as
each layer finishes, so vLLM's blocks are never held after the step: a prompt's are placed (put_start) as the
step begins, each layer written into the pool as it is copied (connectors/layer_store.py) and committed
(put_end) before the step ends; generated ones (keyed on from the prompt's) are stored whole, four at a time,
in the background.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from halfmoon.connectors.vllm_cache import HalfmoonConnectorMetadata
from halfmoon.connectors.vllm_scheduler import HalfmoonConnectorScheduler
from halfmoon.connectors.vllm_side import ConnectorSide
from halfmoon.connectors.vllm_stats import HalfmoonConnectorStats, HalfmoonPromMetrics
from halfmoon.connectors.vllm_worker import HalfmoonConnectorWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class HalfmoonConnector(KVConnectorBase_V1):
    """Contract: the class vLLM loads by this name, once in its scheduler process (``role`` SCHEDULER) and
    once in its worker. It builds the side of its role, ``HalfmoonConnectorScheduler`` or
    ``HalfmoonConnectorWorker`` (connectors/vllm_scheduler.py, connectors/vllm_worker.py), which owns all
    that side holds, and hands each of vLLM's calls to it; a call for the other role's side fails. The
    statistics and the shutdown are each side's own."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._side: ConnectorSide = (HalfmoonConnectorScheduler(vllm_config) if role == KVConnectorRole.SCHEDULER
                                     else HalfmoonConnectorWorker(vllm_config))

    @property
    def _scheduler(self) -> HalfmoonConnectorScheduler:
        assert isinstance(self._side, HalfmoonConnectorScheduler), "a scheduler-side call in vLLM's worker"
        return self._side

    @property
    def _worker(self) -> HalfmoonConnectorWorker:
        assert isinstance(self._side, HalfmoonConnectorWorker), "a worker-side call in vLLM's scheduler"
        return self._side

    def _metadata(self) -> HalfmoonConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HalfmoonConnectorMetadata)
        return meta

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # NOTE: bound before the forward, where start_load_kv may come after it (a step with no loads)
        super().bind_connector_metadata(connector_metadata)
        self._worker.start_saves(self._metadata())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_loads(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # NOTE: kv_layer is the cache the worker registered; it copies from its own views of it
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # ------------------------------------------------------------------ statistics, both sides

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._side.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HalfmoonConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> HalfmoonPromMetrics:
        return HalfmoonPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self._side.shutdown()
