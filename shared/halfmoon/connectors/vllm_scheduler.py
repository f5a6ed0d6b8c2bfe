"""The Halfmoon connector's scheduler side (connectors/vllm.py): which of a request's tokens the pool holds,
and what each step's workers load and store."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from halfmoon.connectors.vllm_cache import HalfmoonConnectorMetadata, LoadSpec, SaveSpec
from halfmoon.connectors.vllm_side import POOL_TIMEOUT_S, ConnectorSide, log
from halfmoon.core.keys import ROOT_KEY, BlockHasher, Namespace
from halfmoon.core.tenants import within_tenant
from halfmoon.engine.interface import STORE_GENERATED_EVERY_BLOCKS
from halfmoon.engine.vllm_engine import KEYS_PARAM, SALT_PARAM, TRACE_PARAM
from halfmoon.protocol.cache import LookupResult

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


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


class HalfmoonConnectorScheduler(ConnectorSide):
    """Contract: lives in vLLM's scheduler process (its engine core), called on the scheduler's thread only.
    It owns the requests' pool keys (``_Prompt``: given by Halfmoon's ``VllmEngine`` or computed here under
    the tenant salt, then chained on over generated tokens), the pool's answers to their lookups (``_Hit``)
    and the leases those hold until the request is looked up again or finishes, and what each step tells
    the workers (``build_connector_meta``: the loads of its newly allocated hits, the saves of the blocks
    it completes). It never touches KV: the worker side moves every byte."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config, "vllm-scheduler")
        self._prompts: dict[str, _Prompt] = {}
        self._hits: dict[str, _Hit] = {}
        self._loading: dict[str, _Hit] = {}

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
        found = self.session.run(self.traced(prompt.trace, "vllm.kv_lookup", self.session.pool.lookup(usable),
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

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        hit = self._hits.get(request.request_id)
        if hit is not None:
            self.stats.add("lookup_tokens", hit.asked - hit.start)
            self.stats.add("hit_tokens", num_external_tokens)
        if num_external_tokens and hit is not None:
            self._loading[request.request_id] = _Hit(hit.found, hit.start, hit.start + num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HalfmoonConnectorMetadata:
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

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        # NOTE: saves end with the step that computed them (wait_for_save), so no block is held past it
        self._prompts.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._release(request.request_id)
        return False, None
