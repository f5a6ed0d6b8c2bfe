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

Scheduler side: ``get_num_new_matched_tokens`` looks the prompt's full blocks up (leased until the request
finishes) and says how many tokens the pool holds beyond vLLM's own cache. Worker side: the reads start with
the step. Where the blocks sit in the DRAM of nodes this process reaches by byte ranges (shared memory,
RDMA), they are read layer by layer (runtime/prefix_layers.py: a ``pool.layer_read`` span per layer, each
layer's MAC verified as it lands), and vLLM's layer ``l`` waits for layer ``l`` only, so the reads of later
layers overlap its compute (a ``vllm.layer_forward`` span per layer, in the request's trace); elsewhere
they are read whole before the first layer. Each layer is copied into vLLM's paged cache just before that
layer's attention; a block that is missing or fails its MAC is reported through
``get_block_ids_with_load_errors``, and vLLM recomputes from there (``kv_load_failure_policy: recompute``).
Every block that a step completes is copied out layer by layer as each layer finishes, so vLLM's blocks are
never held after the step: a prompt's are placed (put_start) as the step begins, each layer written into
the pool as it is copied (connectors/layer_store.py) and committed (put_end) before the step ends; generated
ones (keyed on from the prompt's) are stored whole, four at a time, in the background.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from opentelemetry import context as otel_context
from opentelemetry.trace import Tracer
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index

from halfmoon.connectors.layer_store import LayerStore
from halfmoon.connectors.pool_session import CONNECTION_FIELDS, PoolSession, session_config
from halfmoon.connectors.vllm_cache import HalfmoonConnectorMetadata, LoadSpec, SaveSpec, cache_write_layout, slots
from halfmoon.connectors.vllm_stats import HalfmoonConnectorStats, HalfmoonPromMetrics, StatsCounter
from halfmoon.core.block_format import BlockLayout, blank_block, decode_block
from halfmoon.core.keys import ROOT_KEY, BlockHasher, Namespace
from halfmoon.core.kv_spec import describe
from halfmoon.core.tenants import within_tenant
from halfmoon.engine.interface import STORE_GENERATED_EVERY_BLOCKS, LayerUnavailable
from halfmoon.engine.vllm_engine import KEYS_PARAM, SALT_PARAM, TRACE_PARAM, kv_spec_of
from halfmoon.protocol.cache import LookupResult
from halfmoon.protocol.permissions import KV_CLIENT
from halfmoon.protocol.work import BlockLocation
from halfmoon.runtime.prefix_layers import PrefixLayers
from halfmoon.telemetry.propagation import extract_context
from halfmoon.telemetry.tracing import setup_tracing

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

T = TypeVar("T")
DEFAULT_BLOCK_SIZE = 16  # Halfmoon's engine's default (engine/config.py): the pool's blocks are shared with it
POOL_FIELDS = frozenset({"block_size", "cache_salt", "nats_role", "exit_with_parent"})
POOL_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
log = logging.getLogger("vllm.halfmoon")  # under vLLM's logger, so its handlers print it


def exit_with_parent() -> None:
    """This process (vLLM's engine core, or its worker) gets SIGTERM when the one that started it exits.
    Under Halfmoon's services (engine/vllm_engine.py) vLLM's engine core is the service's child, and it
    does not watch its parent: a SIGKILLed service left it running, holding the model, its KV cache and
    its NATS connections."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        log.warning("HalfmoonConnector: prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    elif os.getppid() == 1:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class _Prompt:
    """A scheduled request as the pool knows it."""

    request: Request  # the scheduler's own: its token ids grow as it generates
    hasher: BlockHasher
    keys: list[bytes]  # every full block of the prompt, then of generated tokens as they are stored
    prompt_blocks: int
    trace: dict[str, str]
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0  # blocks before this one need no store (computed by an earlier step, or loaded)

    def extend_keys(self, blocks: int) -> None:
        """Keys up to ``blocks`` (as far as the request's tokens go), chained on from the last."""
        tokens, size = self.request.all_token_ids, self.hasher.block_size
        for n in range(len(self.keys), min(blocks, len(tokens) // size)):
            self.keys.append(self.hasher.key(self.keys[-1] if self.keys else ROOT_KEY, tokens[n * size:(n + 1) * size]))


@dataclass
class _Hit:
    found: LookupResult
    start: int  # tokens vLLM had itself when it asked
    end: int
    asked: int = 0  # tokens looked up


@dataclass
class _Reading:
    """A load in flight: read whole (``future``) or layer by layer (``layers``)."""

    spec: LoadSpec
    future: concurrent.futures.Future[list[memoryview | None]] | None = None
    layers: PrefixLayers | None = None
    bodies: list[torch.Tensor] | None = None  # whole: [layers, 2, tokens, heads, dim] of each usable block
    end: int = 0  # whole: tokens up to here are usable
    failed: bool = False  # layer by layer: a layer did not arrive intact; vLLM recomputes the load
    places: torch.Tensor | None = None  # layer by layer: where the load's K and V go in each layer's cache


@dataclass
class _Saving:
    """A save in this step: its payloads (filled layer by layer from vLLM's cache), their bodies (views),
    where its tokens sit in each layer's cache, and for a prompt's blocks the store writing each layer into
    the pool as it is filled (``stored``: its run, to the commit)."""

    spec: SaveSpec
    payloads: list[bytearray]
    bodies: list[torch.Tensor]
    places: torch.Tensor
    store: LayerStore | None = None
    stored: concurrent.futures.Future[None] | None = None
    filled: int = 0  # layers copied out of vLLM's cache


class HalfmoonConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        unknown = set(extra) - POOL_FIELDS - CONNECTION_FIELDS
        if unknown:
            raise ValueError(f"HalfmoonConnector: unknown kv_connector_extra_config keys {sorted(unknown)}; known: "
                             f"{sorted(POOL_FIELDS | CONNECTION_FIELDS)}")
        self.block_size = int(extra.get("block_size", DEFAULT_BLOCK_SIZE))
        self.cache_salt: str | None = extra.get("cache_salt")
        self.vllm_block_size: int = vllm_config.cache_config.block_size
        self.spec = kv_spec_of(vllm_config, self.block_size)
        self.layout = BlockLayout.of(self.spec)
        if self.block_size != self.vllm_block_size:
            log.warning("HalfmoonConnector: pool blocks of %d tokens, vLLM blocks of %d: blocks move by token "
                        "position (same-size blocks copy fastest)", self.block_size, self.vllm_block_size)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("HalfmoonConnector: kv_load_failure_policy is %r: a pool block that fails its MAC or "
                        "vanishes fails its request; set it to \"recompute\" to recompute it instead",
                        self._kv_transfer_config.kv_load_failure_policy)
        if extra.get("exit_with_parent"):
            exit_with_parent()
        config = session_config({k: v for k, v in extra.items() if k in CONNECTION_FIELDS})
        name = "vllm-scheduler" if role == KVConnectorRole.SCHEDULER else "vllm-worker"
        user = str(extra.get("nats_role", KV_CLIENT))
        self.session = PoolSession(config, self.layout, name, user=user)
        # spans go where the service's go (HALFMOON_TRACE_FILE, OTEL_*), under the service's name
        self._tracing = setup_tracing("vllm" if user == KV_CLIENT else user, self.session.instance_id,
                                      config.trace_file or None)
        self.tracer: Tracer = self._tracing.get_tracer(__name__)
        self.stats = StatsCounter()
        log.info("HalfmoonConnector (%s) on %s namespace %s: KV %s", name, config.nats_url, config.namespace,
                 describe(self.spec))
        # scheduler side
        self._prompts: dict[str, _Prompt] = {}
        self._hits: dict[str, _Hit] = {}
        self._loading: dict[str, _Hit] = {}
        # worker side
        self._layers: list[torch.Tensor] = []  # per layer: every block's elements, flat
        self._block_elements = 0
        self._offsets = torch.empty(0, dtype=torch.long)  # cache_write_layout's
        self._layer_index: dict[str, int] = {}
        self._reading: list[_Reading] = []
        self._layer_times: list[tuple[int, int, int]] = []  # this step: (layer, its wait began, its KV in), ns
        self._saving: list[_Saving] = []
        self._load_errors: set[int] = set()

    # ------------------------------------------------------------------ scheduler side

    def _hasher(self, request: Request) -> BlockHasher:
        params = request.kv_transfer_params or {}
        if SALT_PARAM in params:  # Halfmoon's VllmEngine: its service's tenant salt
            salt = params[SALT_PARAM]
        else:
            salt = getattr(request, "cache_salt", None)
            if self.cache_salt is not None:
                salt = within_tenant(self.cache_salt, salt)
        return BlockHasher(self.block_size, Namespace(self.spec.model_fingerprint, salt))

    def _prompt(self, request: Request) -> _Prompt:
        prompt = self._prompts.get(request.request_id)
        if prompt is None:
            params = request.kv_transfer_params or {}
            hasher, given = self._hasher(request), params.get(KEYS_PARAM)
            if given is not None:  # Halfmoon's VllmEngine: its service keyed the blocks
                keys = [bytes.fromhex(key) for key in given][:request.num_prompt_tokens // self.block_size]
            else:
                keys = hasher.keys(list(request.prompt_token_ids or []))
            trace = dict(params.get(TRACE_PARAM) or getattr(request, "trace_headers", None) or {})
            prompt = self._prompts[request.request_id] = _Prompt(request, hasher, keys, len(keys), trace)
        return prompt

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = self._prompt(request)
        # NOTE: vLLM computes at least the prompt's last token itself
        usable = prompt.keys[:(request.num_prompt_tokens - 1) // self.block_size]
        self._release(request.request_id)
        if len(usable) * self.block_size <= num_computed_tokens:
            return 0, False
        found = self.session.run(self._traced(prompt.trace, "vllm.kv_lookup", self.session.pool.lookup(usable),
                                              request.request_id), POOL_TIMEOUT_S)
        if found is None:
            return 0, False
        hits = 0
        for hit, key in zip(found.hits, usable):
            if hit.key != key or not hit.replicas:
                break
            hits += 1
        end = hits * self.block_size
        self._hits[request.request_id] = _Hit(found, num_computed_tokens, end, len(usable) * self.block_size)
        if end <= num_computed_tokens:
            return 0, False
        log.info("HalfmoonConnector: pool hit of %d prompt tokens for %s (vLLM had %d)", end, request.request_id,
                 num_computed_tokens)
        return end - num_computed_tokens, False

    async def _traced(self, trace: dict[str, str], name: str, work: Awaitable[T], request_id: str) -> T:
        """``work`` in a span of the request's trace, so the pool's spans (cache-manager, transfer) join it."""
        attached = otel_context.attach(extract_context(trace))
        try:
            with self.tracer.start_as_current_span(name, attributes={"halfmoon.request_id": request_id}):
                return await work
        finally:
            otel_context.detach(attached)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        hit = self._hits.get(request.request_id)
        if hit is not None:
            self.stats.add("lookup_tokens", hit.asked - hit.start)
            self.stats.add("hit_tokens", num_external_tokens)
        if num_external_tokens and hit is not None:
            self._loading[request.request_id] = _Hit(hit.found, hit.start, hit.start + num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HalfmoonConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt = self._prompts.get(new.req_id)
            if prompt is None:  # a request vLLM never asked about (none is): nothing to load or store
                continue
            prompt.block_ids = list(new.block_ids[0])
            prompt.stored = new.num_computed_tokens // self.block_size
            self._add_load(meta, new.req_id, prompt)
            self._add_save(meta, new.req_id, prompt, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            prompt = self._prompts.get(req_id)
            if prompt is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after a preemption: every block anew
                prompt.block_ids = list(added[0]) if added else []
            elif added:
                prompt.block_ids.extend(added[0])
            self._add_load(meta, req_id, prompt)
            self._add_save(meta, req_id, prompt, cached.num_computed_tokens[i] + scheduled[req_id])
        return meta

    def _add_load(self, meta: HalfmoonConnectorMetadata, req_id: str, prompt: _Prompt) -> None:
        hit = self._loading.pop(req_id, None)
        if hit is None:
            return
        first, last = hit.start // self.block_size, -(-hit.end // self.block_size)
        replicas = [h.replicas[0] for h in hit.found.hits[first:last]]
        meta.loads.append(LoadSpec(req_id, list(prompt.block_ids), hit.start, hit.end, first, replicas, prompt.trace))

    def _add_save(self, meta: HalfmoonConnectorMetadata, req_id: str, prompt: _Prompt, computed: int) -> None:
        """The blocks ``computed`` tokens complete: the prompt's at once, generated ones a few at a time."""
        full = computed // self.block_size
        if full - len(prompt.keys) >= STORE_GENERATED_EVERY_BLOCKS:
            prompt.extend_keys(full)
        full = min(full, len(prompt.keys))
        if full > prompt.stored:
            meta.saves.append(SaveSpec(req_id, list(prompt.block_ids), prompt.stored, prompt.keys[prompt.stored:full],
                                       prompt.trace, wait=prompt.stored < prompt.prompt_blocks))
            prompt.stored = full

    def _release(self, req_id: str) -> None:
        hit = self._hits.pop(req_id, None)
        if hit is not None and hit.found.lease_id is not None:
            self.session.submit(self.session.pool.release(hit.found.lease_id))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # NOTE: saves end with the step that computed them (wait_for_save), so no block is held past it
        self._prompts.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._release(request.request_id)
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        spec = self.spec
        by_index = sorted((extract_layer_index(name), name) for name in kv_caches)
        if [index for index, _ in by_index] != list(range(spec.num_layers)):
            raise ValueError(f"HalfmoonConnector: vLLM's KV caches are for layers {[i for i, _ in by_index]}, "
                             f"the model has {spec.num_layers}")
        for index, name in by_index:
            cache = kv_caches[name]
            # NOTE: vLLM's CPU attention: [blocks, kv heads, block size, 2 * head dim]; inside a block, its own layout
            expected = (spec.num_kv_heads, self.vllm_block_size, 2 * spec.head_dim)
            if cache.dim() != 4 or tuple(cache.shape[1:]) != expected or cache.dtype != self.layout.dtype:
                raise ValueError(f"HalfmoonConnector: layer {name}'s KV cache is {tuple(cache.shape)} "
                                 f"{cache.dtype}; this connector knows vLLM's CPU layout [blocks, {expected[0]}, "
                                 f"{expected[1]}, {expected[2]}] {self.layout.dtype}")
            self._layers.append(cache.view(-1))
            self._block_elements = cache[0].numel()
            self._layer_index[name] = index
        self._offsets = cache_write_layout(self.layout.dtype, spec.num_kv_heads, self.vllm_block_size, spec.head_dim)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # NOTE: bound before the forward, where start_load_kv may come after it (a step with no loads)
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, HalfmoonConnectorMetadata)
        self._saving = [self._start_save(save) for save in connector_metadata.saves]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HalfmoonConnectorMetadata)
        self._reading = [self.session.run(self._start_read(load), POOL_TIMEOUT_S) for load in meta.loads]
        self._layer_times = []

    async def _start_read(self, load: LoadSpec) -> _Reading:
        if not await self.session.pool.ranged(load.replicas):
            whole = self._traced(load.trace, "vllm.kv_load", self.session.pool.read(load.replicas), load.request_id)
            return _Reading(load, future=self.session.submit(whole))
        attached = otel_context.attach(extract_context(load.trace))
        try:  # the reading task starts in the request's trace
            layers = PrefixLayers(self.session.pool.layout, load.replicas, self.block_size, self.session.transfer,
                                  self.tracer, log, self.session.pool.report_corrupt, span_name="vllm.kv_load")
            layers.start()
        finally:
            otel_context.detach(attached)
        return _Reading(load, layers=layers)

    def _arrived(self, reading: _Reading) -> list[torch.Tensor]:
        """The usable blocks of a load once read; what is missing or corrupt is a load error from its first
        token on (vLLM recomputes from the first failed block)."""
        if reading.bodies is not None:
            return reading.bodies
        spec = reading.spec
        assert reading.future is not None
        try:
            payloads = reading.future.result(POOL_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, OSError) as exc:
            log.warning("HalfmoonConnector: pool read for %s failed: %s", spec.request_id, exc)
            payloads = []
        bodies = []
        for payload in payloads:
            if payload is None:
                break
            bodies.append(decode_block(self.layout, payload))  # MACs verified as the read landed
        reading.bodies = bodies
        reading.end = min(spec.end, (spec.first_block + len(bodies)) * self.block_size)
        self.stats.add("loaded_tokens", max(0, reading.end - spec.start))
        if reading.end < spec.end:
            failed, _ = slots(spec.block_ids, self.vllm_block_size, reading.end, spec.end)
            self._load_errors.update(failed.tolist())
            self.stats.add("load_error_blocks", len(failed))
            log.warning("HalfmoonConnector: %d of %d pool blocks for %s missing or corrupt: vLLM recomputes "
                        "tokens from %d", len(spec.replicas) - len(bodies), len(spec.replicas), spec.request_id,
                        reading.end)
        else:
            log.info("HalfmoonConnector: loading %d tokens of %s from the pool", spec.end - spec.start,
                     spec.request_id)
        return bodies

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._reading:
            return
        began = time.time_ns()
        cache = self._layers[layer]
        for reading in self._reading:
            spec = reading.spec
            if reading.layers is not None:
                self._fill_layer(reading, layer, cache)
                continue
            bodies = self._arrived(reading)
            for n, body in enumerate(bodies):
                block_start = (spec.first_block + n) * self.block_size
                lo, hi = max(spec.start, block_start), min(reading.end, block_start + self.block_size)
                if lo >= hi:
                    continue
                cache[self._places(spec.block_ids, lo, hi)] = body[layer, :, lo - block_start:hi - block_start]
        self._layer_times.append((layer, began, time.time_ns()))

    def _fill_layer(self, reading: _Reading, layer: int, cache: torch.Tensor) -> None:
        """Layer ``layer`` of a load read layer by layer, once it is in; a layer that failed fails the load."""
        spec = reading.spec
        if reading.failed:
            return
        assert reading.layers is not None
        try:
            kv = reading.layers.layer(layer)  # [2, tokens of the blocks, heads, dim]
        except LayerUnavailable as exc:
            reading.failed = True
            failed, _ = slots(spec.block_ids, self.vllm_block_size, spec.start, spec.end)
            self._load_errors.update(failed.tolist())
            self.stats.add("load_error_blocks", len(failed))
            log.warning("HalfmoonConnector: pool blocks for %s missing or corrupt at layer %d (%s): vLLM recomputes "
                        "tokens from %d", spec.request_id, layer, exc, spec.start)
            return
        if layer == 0:
            log.info("HalfmoonConnector: loading %d tokens of %s from the pool, layer by layer",
                     spec.end - spec.start, spec.request_id)
        base = spec.first_block * self.block_size
        if reading.places is None:  # the same places in every layer
            reading.places = self._places(spec.block_ids, spec.start, spec.end).flatten()
        cache.index_copy_(0, reading.places, kv[:, spec.start - base:spec.end - base].flatten())
        if layer == self.spec.num_layers - 1:
            self.stats.add("loaded_tokens", spec.end - spec.start)

    def _trace_layers(self, ended: int) -> None:
        """The step's layers, as computed after each one's KV was in: ``vllm.layer_forward`` spans (from the
        layer's KV in to the next layer's wait) in the trace of each load read layer by layer."""
        times = self._layer_times
        for reading in self._reading:
            if reading.layers is None:
                continue
            parent = extract_context(reading.spec.trace)
            for n, (layer, began, ready) in enumerate(times):
                end = times[n + 1][1] if n + 1 < len(times) else ended
                span = self.tracer.start_span("vllm.layer_forward", context=parent, start_time=ready,
                                              attributes={"halfmoon.layer": layer,
                                                          "halfmoon.request_id": reading.spec.request_id,
                                                          "halfmoon.layer_wait_ms": (ready - began) / 1e6})
                span.end(end_time=end)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._saving:
            return
        cache = self._layers[layer]
        size = self.block_size
        for saving in self._saving:
            kv = cache[saving.places]  # [2, tokens, heads, dim]
            for n, body in enumerate(saving.bodies):
                body[layer].copy_(kv[:, n * size:(n + 1) * size])
            saving.filled += 1
            if saving.store is not None:
                saving.store.sink(layer)

    def _places(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Indices into a layer's flat cache of K and V of tokens ``[start, end)``: ``[2, tokens, heads, dim]``,
        as Halfmoon's block bodies hold them."""
        blocks, offsets = slots(block_ids, self.vllm_block_size, start, end)
        return blocks[None, :, None, None] * self._block_elements + self._offsets[:, offsets]

    def _start_save(self, save: SaveSpec) -> _Saving:
        """Empty payloads for a save, their bodies (views) and where their tokens sit in each layer; a
        prompt's blocks are placed in the pool at once, and each layer is written there as it is filled."""
        payloads = [blank_block(self.layout, self.block_size) for _ in save.keys]
        start = save.first_block * self.block_size
        places = self._places(save.block_ids, start, start + len(save.keys) * self.block_size)
        saving = _Saving(save, payloads, [decode_block(self.layout, payload) for payload in payloads], places)
        if save.wait:
            saving.store = LayerStore(self.session.pool, self.tracer, save.request_id, save.keys, payloads,
                                      save.first_block, self.block_size, self.session.call_soon)
            saving.stored = self.session.submit(self._store(save, saving.store.store()))
        return saving

    def wait_for_save(self) -> None:
        self._trace_layers(time.time_ns())
        for reading in self._reading:
            if reading.layers is not None:
                reading.layers.close()
        self._reading, self._layer_times = [], []
        saving, self._saving = self._saving, []
        for save in saving:
            if save.filled < self.spec.num_layers:  # no forward ran the step's layers: nothing to store
                if save.stored is not None:
                    save.stored.cancel()
            elif save.stored is not None:
                try:
                    save.stored.result(POOL_TIMEOUT_S)
                except concurrent.futures.TimeoutError:  # the blocks stay unpublished: a reader recomputes them
                    save.stored.cancel()
                    log.warning("HalfmoonConnector: storing blocks %d.. of %s timed out", save.spec.first_block,
                                save.spec.request_id)
            else:  # generated tokens' blocks, whole, in the background
                self.session.submit(self._store(save.spec, self.session.pool.store(save.spec.keys, save.payloads,
                                                                                   save.spec.first_block)))

    async def _store(self, save: SaveSpec, storing: Coroutine[Any, Any, dict[bytes, BlockLocation]]) -> None:
        try:
            stored = await self._traced(save.trace, "vllm.kv_store", storing, save.request_id)
        except Exception:  # a block not stored is recomputed by whoever wants it
            log.exception("HalfmoonConnector: storing blocks %d.. of %s failed", save.first_block, save.request_id)
            return
        self.stats.add("stored_blocks", len(stored))
        log.info("HalfmoonConnector: stored %d of %d blocks %d.. of %s in the pool", len(stored), len(save.keys),
                 save.first_block, save.request_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ statistics, both sides

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HalfmoonConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> HalfmoonPromMetrics:
        return HalfmoonPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self.session.close()
        self._tracing.shutdown()
