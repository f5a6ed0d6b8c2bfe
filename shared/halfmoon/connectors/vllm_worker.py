"""The Halfmoon connector's worker side (connectors/vllm.py): each step's KV between the pool and vLLM's
paged cache, layer by layer."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from opentelemetry import context as otel_context
from vllm.model_executor.models.utils import extract_layer_index

from halfmoon.connectors.layer_store import LayerStore
from halfmoon.connectors.vllm_cache import HalfmoonConnectorMetadata, LoadSpec, SaveSpec, cache_write_layout, slots
from halfmoon.connectors.vllm_side import POOL_TIMEOUT_S, ConnectorSide, log
from halfmoon.core.block_format import blank_block, decode_block
from halfmoon.engine.interface import LayerUnavailable
from halfmoon.protocol.work import BlockLocation
from halfmoon.runtime.prefix_layers import PrefixLayers
from halfmoon.telemetry.propagation import extract_context

if TYPE_CHECKING:
    from vllm.config import VllmConfig


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


class HalfmoonConnectorWorker(ConnectorSide):
    """Contract: lives in vLLM's worker process, called on the thread that runs the model, one step at a
    time: ``start_saves`` as the step's metadata is bound (before the forward), ``start_loads`` before the
    first layer where the step loads (vLLM calls it after the forward in a step with no loads),
    ``wait_for_layer_load`` and ``save_kv_layer`` around each layer's attention, ``wait_for_save`` as the
    step ends. It owns the views of vLLM's paged KV caches
    (``register_kv_caches``: vLLM's CPU layout only) and where each token's K and V sit in them, the step's
    reads (``_Reading``) and saves (``_Saving``), and the vLLM blocks whose load failed until vLLM takes
    them (``get_block_ids_with_load_errors``). Nothing of vLLM's cache is held past the step."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config, "vllm-worker")
        self._layers: list[torch.Tensor] = []  # per layer: every block's elements, flat
        self._block_elements = 0
        self._offsets = torch.empty(0, dtype=torch.long)  # cache_write_layout's
        self._layer_index: dict[str, int] = {}
        self._reading: list[_Reading] = []
        self._layer_times: list[tuple[int, int, int]] = []  # this step: (layer, its wait began, its KV in), ns
        self._saving: list[_Saving] = []
        self._load_errors: set[int] = set()

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

    def start_saves(self, meta: HalfmoonConnectorMetadata) -> None:
        self._saving = [self._start_save(save) for save in meta.saves]

    def start_loads(self, meta: HalfmoonConnectorMetadata) -> None:
        self._reading = [self.session.run(self._start_read(load), POOL_TIMEOUT_S) for load in meta.loads]
        self._layer_times = []

    async def _start_read(self, load: LoadSpec) -> _Reading:
        if not await self.session.pool.ranged(load.replicas):
            whole = self.traced(load.trace, "vllm.kv_load", self.session.pool.read(load.replicas), load.request_id)
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

    def save_kv_layer(self, layer_name: str) -> None:
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
            stored = await self.traced(save.trace, "vllm.kv_store", storing, save.request_id)
        except Exception:  # a block not stored is recomputed by whoever wants it
            log.exception("HalfmoonConnector: storing blocks %d.. of %s failed", save.first_block, save.request_id)
            return
        self.stats.add("stored_blocks", len(stored))
        log.info("HalfmoonConnector: stored %d of %d blocks %d.. of %s in the pool", len(stored), len(save.keys),
                 save.first_block, save.request_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
