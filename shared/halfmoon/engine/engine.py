"""LLMEngine: requests in, tokens out, one scheduled step at a time."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from halfmoon.core.block_format import BlockLayout, encode_block
from halfmoon.core.detokenizer import IncrementalDetokenizer
from halfmoon.core.errors import (
    ContextLengthError,
    DuplicateRequestError,
    InvalidRequestError,
    OutOfKVBlocksError,
    UnknownRequestError,
)
from halfmoon.core.kv_spec import KVSpec
from halfmoon.engine.attention import PagedKVCache
from halfmoon.engine.block_manager import BlockManager
from halfmoon.engine.block_pool import BlockStored
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.context import context_limit
from halfmoon.engine.hooks import LayerHooks
from halfmoon.engine.host_memory import HostMemory, host_bytes, step_working_bytes
from halfmoon.engine.interface import NO_KV, PREFILL_DONE, EngineStats, LayerSource, RequestKV, RequestOutput
from halfmoon.engine.layer_export import LayerExport
from halfmoon.engine.layer_import import LayerImport, ReadyKV
from halfmoon.engine.loader import load_model
from halfmoon.engine.model_runner import ModelRunner
from halfmoon.engine.sampler import Sampler
from halfmoon.engine.scheduler import Scheduler
from halfmoon.engine.sequence import Sequence, SequenceStatus
from halfmoon.engine.stage import PipelineStages, StageParts
from halfmoon.engine.step_budget import StepBudget
from halfmoon.protocol.sampling import SamplingParams


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    prefill_only: bool
    export_prompt_from: int | None = None


class LLMEngine:
    """A paged-KV, continuously batching engine over a local Llama-family model.

    Not thread-safe: one caller drives ``step``. Services never see it: ``AsyncEngine`` runs it on one
    thread behind the ``Engine`` interface (engine/interface.py), whose contract its methods follow.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        loaded = load_model(config.model, config.torch_dtype, config.torch_device)
        self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.name
        hf = self.model.config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.kv_spec = KVSpec(model_fingerprint=loaded.fingerprint.hex(), block_size=config.block_size,
                              dtype=config.resolved_dtype, num_layers=hf.num_hidden_layers,
                              num_kv_heads=hf.num_key_value_heads, head_dim=head_dim)
        self.layout = BlockLayout.of(self.kv_spec)
        self.vocab_size, self.hidden_size = hf.vocab_size, hf.hidden_size
        self.max_model_len = context_limit(hf, config.max_model_len)
        per_block = self.layout.layer_nbytes(config.block_size) * hf.num_hidden_layers
        num_blocks = config.kv_cache_blocks or max(1, config.kv_cache_bytes // per_block)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.cache = PagedKVCache(hf.num_hidden_layers, num_blocks, config.block_size, hf.num_key_value_heads,
                                  head_dim, config.torch_dtype, config.torch_device)
        self.runner = ModelRunner(self.model, self.cache, self.blocks)
        self.last_step_tokens = 0  # tokens the last step computed (decode: 1 per sequence; prefill: its chunk)
        self.layer_import = LayerImport()
        self.layer_export = LayerExport(self.layout, config.block_size)
        self.runner.layer_hook = LayerHooks(self.layer_import, self.layer_export)
        budget = StepBudget(config.step_time_target_s, config.max_num_batched_tokens,
                            min(config.block_size, config.prefill_chunk_size))
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.prefill_chunk_size, budget)
        self.sampler = Sampler()
        self._seeds = random.Random(config.seed)  # seeds for requests that bring none
        self.eos_token_ids = self._eos_ids()
        self._requests: dict[str, _Request] = {}
        self._arrivals = 0
        # requests this engine runs one pipeline stage of
        self.stages = PipelineStages(StageParts(self.layout, self.hidden_size, self.vocab_size, self.max_model_len,
                                                self.tokenizer, self.blocks, self.cache, self.runner, self.sampler,
                                                self.token_ending, self.request_seed))

    def _eos_ids(self) -> frozenset[int]:
        found = getattr(self.model.generation_config, "eos_token_id", None)
        if found is None and self.tokenizer is not None:
            found = self.tokenizer.eos_token_id
        return frozenset([found] if isinstance(found, int) else (found or []))

    @property
    def fingerprint(self) -> bytes:
        return self.layout.fingerprint

    def host_memory(self) -> HostMemory:
        hf, config = self.model.config, self.config
        step = step_working_bytes(
            max_num_batched_tokens=config.max_num_batched_tokens, prefill_chunk_size=config.prefill_chunk_size,
            max_num_seqs=config.max_num_seqs, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
            num_heads=hf.num_attention_heads, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            dtype_bytes=config.torch_dtype.itemsize)
        held = [*self.model.parameters(), *self.model.buffers(), *self.runner.serving_weights()]
        return HostMemory(weights=host_bytes(held),
                          kv_cache=host_bytes([self.cache.data]),
                          step=step if config.torch_device.type == "cpu" else 0,
                          block_bytes=self.layout.layer_nbytes(config.block_size) * hf.num_hidden_layers)

    # ----------------------------------------------------------------- requests
    def _validate(self, request_id: str, tokens: list[int], outputs: list[int], params: SamplingParams) -> None:
        """``outputs`` (tokens sampled elsewhere, e.g. prefill's first) are part of ``max_tokens``, so the
        context check is prompt + max_tokens whichever instance runs it: the gateway's, token for token."""
        if request_id in self._requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in the engine")
        if not tokens:
            raise InvalidRequestError("prompt is empty: at least one token is required")
        bad = next((t for t in tokens + outputs if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer, and this model directory has none")
        if len(tokens) + params.max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"prompt ({len(tokens)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"model's context length of {self.max_model_len} tokens"
            )
        if -(-(len(tokens) + params.max_tokens) // self.config.block_size) > self.blocks.pool.num_blocks:
            raise OutOfKVBlocksError(f"request needs more KV blocks than the whole cache holds "
                                     f"({self.blocks.pool.num_blocks})")

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                    output_token_ids: Seq[int] = (), block_keys: Seq[bytes] = (), prefill_only: bool = False,
                    kv: RequestKV = NO_KV, step_target_s: float = 0.0) -> None:
        """Queue a request (the parameters are ``Engine.generate``'s, engine/interface.py).

        ``kv.source`` payloads are the blocks ``export_kv`` makes; they, or a ``LayerSource``, are
        copied in layer by layer (engine/layer_import.py) where the local prefix cache's reuse reaches
        ``kv.start_block``, and not recomputed. ``kv.sink`` is fed by engine/layer_export.py. A
        prefill-only request keeps its KV for ``export_kv`` until ``release``.
        """
        tokens = [int(t) for t in prompt_token_ids]
        outputs = [int(t) for t in output_token_ids]
        self._validate(request_id, tokens, outputs, params)
        if not (math.isfinite(step_target_s) and step_target_s >= 0):
            raise InvalidRequestError(f"step_target_s must be a finite number >= 0, got {step_target_s}")
        size = self.config.block_size
        if len(block_keys) > len(tokens) // size:
            raise InvalidRequestError("more block keys than full prompt blocks")
        source = (None if not kv.has_source else kv.source if isinstance(kv.source, LayerSource)
                  else ReadyKV(self.layout, kv.source))
        kv.check(prefill_only=prefill_only, num_tokens=len(tokens) + len(outputs),
                 source_tokens=source.num_tokens if source is not None else 0, block_size=size)
        seq = Sequence(request_id, tokens, params, self._arrivals, outputs, tuple(block_keys),
                       seed=self.request_seed())
        if source is not None:
            seq.kv_import, seq.kv_import_start = source, kv.start_block
        self._arrivals += 1
        seq.hold_kv = prefill_only
        seq.step_target_s = step_target_s
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, outputs)
        self._requests[request_id] = _Request(seq, detok, prefill_only, kv.export_prompt_from)
        if kv.sink is not None:
            self.layer_export.watch(request_id, kv.sink_from_block, kv.sink)
        self.scheduler.add(seq)

    def request_seed(self) -> int:
        """The sampling seed of a request that brings none."""
        return self._seeds.getrandbits(63)

    def cached_prefix_blocks(self, block_keys: Seq[bytes]) -> int:
        """How many leading blocks of ``block_keys`` the local prefix cache holds right now."""
        return self.blocks.pool.match(block_keys)

    def cached_block_keys(self) -> list[bytes]:
        """Every key the local prefix cache holds (a snapshot for the conductor's index)."""
        return list(self.blocks.pool.cached)

    def take_cache_events(self) -> tuple[list[bytes], list[bytes]]:
        """Keys stored in and evicted from the local prefix cache since the last call."""
        stored: list[bytes] = []
        evicted: list[bytes] = []
        for event in self.blocks.pool.take_events():
            (stored if isinstance(event, BlockStored) else evicted).extend(event.keys)
        return stored, evicted

    def abort(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            raise UnknownRequestError(request_id)
        self.layer_export.forget(request_id)
        if request.seq.kv_import is not None:  # never scheduled: its transfers can stop
            request.seq.kv_import.close()
            request.seq.kv_import = None
        request.seq.hold_kv = False
        if request.seq.status is SequenceStatus.FINISHED:
            self.blocks.free(request.seq)
        else:
            self.scheduler.finish(request.seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.pool.num_free

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.blocks.pool.num_free,
                           self.blocks.pool.num_blocks)

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        began = time.perf_counter()
        chunks = self.scheduler.schedule()
        self.last_step_tokens = sum(self.scheduler.last_step)
        if not chunks:
            return []
        for chunk in chunks:
            self._expect_import(chunk.seq)
        logits = self.runner.forward(chunks)
        failed = self.layer_import.finish()
        for seq in failed:  # its KV is incomplete: none of this step's work on it counts
            self.scheduler.recompute(seq)
        sampling = [c.seq for c in chunks if c.samples]
        if failed:  # logits has one row per sampling chunk: keep the others' rows
            kept = [i for i, seq in enumerate(sampling) if seq not in failed]
            logits, sampling = logits[kept], [sampling[i] for i in kept]
        sampled = self.sampler(logits, sampling) if sampling else None
        seconds = time.perf_counter() - began
        self.scheduler.record_step_time(seconds)
        per_token = seconds / self.last_step_tokens
        for chunk in chunks:
            if chunk.seq in failed:
                continue
            chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
            chunk.seq.compute_s += per_token * chunk.num_tokens
            self.blocks.register_computed(chunk.seq)
        if sampled is None:
            return []
        return [self._append(seq, token, logprob)
                for seq, token, logprob in zip(sampling, sampled.token_ids, sampled.logprobs)]

    def _expect_import(self, seq: Sequence) -> None:
        """Have the imported KV the local cache did not cover copied in, layer by layer, as the step runs."""
        if seq.kv_import is None:
            return
        if seq.kv_load_from is None:  # the local cache covered it all
            seq.kv_import.close()
            seq.kv_import = None
            return
        size = self.config.block_size
        offset = seq.kv_load_from - seq.kv_import_start * size
        self.layer_import.expect(seq, seq.block_table[seq.kv_load_from // size:], offset)

    def _append(self, seq: Sequence, token: int, logprob: float) -> RequestOutput:
        request = self._requests[seq.request_id]
        params = seq.params
        seq.token_ids.append(token)
        seq.output_logprobs.append(logprob)
        num_out = len(seq.output_token_ids)
        text, reason = self.token_ending(request.detokenizer, params, token, num_out, seq.num_tokens,
                                         request.prefill_only)
        prompt_kv: list[bytearray] = []
        if request.export_prompt_from is not None:
            prompt_kv = self._payloads(seq, request.export_prompt_from, seq.num_computed_tokens // self.config.block_size)
            request.export_prompt_from = None
        if reason is not None:
            seq.finish_reason = reason
            self.layer_export.forget(seq.request_id)  # every layer went out in this step
            self.scheduler.finish(seq)
            if not seq.hold_kv:
                del self._requests[seq.request_id]
        return RequestOutput(seq.request_id, [token], [logprob], text, reason is not None, reason,
                             seq.num_prompt_tokens, seq.num_cached_tokens, num_out, seq.compute_s, prompt_kv)

    def token_ending(self, detokenizer: IncrementalDetokenizer, params: SamplingParams, token: int, num_out: int,
                     num_tokens: int, prefill_only: bool) -> tuple[str, str | None]:
        """The text a new output token adds, and why the output ends with it (None: it goes on). ``num_out``
        and ``num_tokens`` count it."""
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return detokenizer.flush(), "stop"
        text, stopped = detokenizer.push((token,))
        reason = ("stop" if stopped else "length" if num_out >= params.max_tokens or num_tokens >= self.max_model_len
                  else PREFILL_DONE if prefill_only else None)
        return (text + detokenizer.flush() if reason not in (None, PREFILL_DONE) else text), reason

    # ------------------------------------------------------------------ KV I/O
    def export_kv(self, request_id: str, first_block: int = 0, end_block: int | None = None) -> list[bytearray]:
        """Payloads of the request's computed KV in blocks ``first_block`` to ``end_block`` (exclusive; None:
        all), ``block_size`` tokens each (the last computed one may be partial); fewer when fewer are computed."""
        request = self._requests.get(request_id)
        if request is None:
            raise UnknownRequestError(request_id)
        computed = -(-request.seq.num_computed_tokens // self.config.block_size)
        return self._payloads(request.seq, first_block, computed if end_block is None else min(end_block, computed))

    def _payloads(self, seq: Sequence, first: int, end: int) -> list[bytearray]:
        """Pool-format payloads of the computed KV in blocks ``first`` to ``end`` (exclusive)."""
        size = self.config.block_size
        payloads = []
        for index in range(first, end):
            tokens = min(size, seq.num_computed_tokens - index * size)
            payloads.append(encode_block(self.layout, self.cache.blocks([seq.block_table[index]], tokens)))
        return payloads

    def release(self, request_id: str) -> None:
        """Free the KV a prefill-only request kept for export."""
        request = self._requests.pop(request_id, None)
        if request is None:
            raise UnknownRequestError(request_id)
        self.blocks.free(request.seq)

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams) -> list[list[int]]:
        """Run ``prompts`` to completion together; output token ids per prompt."""
        ids = [f"generate-{self._arrivals + i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            self.add_request(request_id, prompt, params)
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                outputs[out.request_id].extend(out.new_token_ids)
        return [outputs[i] for i in ids]
