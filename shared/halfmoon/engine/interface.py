"""The engine seam: what every service needs of an engine, and nothing of how one works.

Services, the runtime and the pipeline stages talk to an ``Engine`` only. ``AsyncEngine`` (Halfmoon's
own ``LLMEngine`` on its thread) and ``VllmEngine`` (vLLM's ``AsyncLLM``) implement it. The KV a request
loads and the KV it stores are described by one ``RequestKV`` handed over when the request is added, never
by calls into the engine afterwards: the source is read and the sink is fed on the engine's side, in layer
order. An engine whose workers move KV themselves (vLLM's v1 KV connector, inside its worker processes)
takes none: it reads and writes the pool by the request's block keys (``Engine.pool_kv``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple

import torch

from halfmoon.core.block_format import BlockLayout
from halfmoon.core.errors import EngineError, InvalidRequestError
from halfmoon.core.kv_spec import KVSpec
from halfmoon.protocol.sampling import SamplingParams

PREFILL_DONE = "prefill_done"
# a request's generated KV goes to the pool once this many new full blocks are computed: a store per block
# would cost a round trip every block_size tokens
STORE_GENERATED_EVERY_BLOCKS = 4
"""The finish reason of a prefill-only request's first token when the output goes on in decode."""


class LayerUnavailable(EngineError):
    """A layer of an imported prefix will not arrive (lost, corrupt, too late)."""


class LayerSource(ABC):
    """KV of ``num_tokens`` consecutive tokens from a block boundary, by layer. Contract: ``layer(l)``
    is called on the engine thread for l = 0, 1, ... in order; it returns ``[2, tokens, heads,
    dim]`` once that layer is in and intact (blocking until then) or raises ``LayerUnavailable``;
    ``close`` says no more layers will be asked for (a source may stop its transfers)."""

    @property
    @abstractmethod
    def num_tokens(self) -> int: ...

    @abstractmethod
    def layer(self, layer: int) -> torch.Tensor: ...

    def close(self) -> None:
        return None


LayerSink = Callable[[int, list[bytearray]], None]
"""Called on the engine thread with a completed layer and the request's payloads (the same list every
time; layers after it are still zero). It must not block: hand the work to another thread or loop."""

Payload = bytes | bytearray | memoryview


@dataclass(frozen=True)
class RequestKV:
    """The KV one request moves in and out, fixed when it is added.

    ``source``: the prefix KV to load from block ``start_block`` on (the blocks before it are in the
    local prefix cache): pool-format payloads already fetched and verified, or a ``LayerSource`` whose
    layers are still arriving; the engine loads only what its local cache does not cover when it
    schedules the request, and computes the rest. ``sink`` (prefill-only requests) receives blocks
    ``sink_from_block`` onwards layer by layer as the chunk that ends the prompt computes them. With
    ``export_prompt_from``, the first output carries the payloads of the prompt's full blocks from that
    block on (``RequestOutput.prompt_kv``), taken before the request can finish and free them.
    """

    source: Seq[Payload] | LayerSource = ()
    start_block: int = 0
    sink: LayerSink | None = None
    sink_from_block: int = 0
    export_prompt_from: int | None = None

    def __post_init__(self) -> None:
        if self.start_block < 0 or self.sink_from_block < 0 or (self.export_prompt_from or 0) < 0:
            raise InvalidRequestError(f"block indexes are >= 0: start_block {self.start_block}, sink_from_block "
                                      f"{self.sink_from_block}, export_prompt_from {self.export_prompt_from}")
        if self.sink_from_block and self.sink is None:
            raise InvalidRequestError("sink_from_block says where a sink starts: give the sink too")

    @property
    def has_source(self) -> bool:
        return isinstance(self.source, LayerSource) or bool(self.source)

    def check(self, *, prefill_only: bool, num_tokens: int, source_tokens: int, block_size: int) -> None:
        """Refuse what this KV cannot do for a request of ``num_tokens`` tokens whose source holds
        ``source_tokens``: a sink streams a prefill-only request, and imported KV leaves the last token
        to compute (its logits give the next one)."""
        if self.sink is not None and not prefill_only:
            raise InvalidRequestError("layer-wise export (a sink) is for prefill-only requests")
        if source_tokens and self.start_block * block_size + source_tokens >= num_tokens:
            raise InvalidRequestError("imported KV must leave at least the last token to compute")


NO_KV = RequestKV()


class RequestOutput(NamedTuple):
    """What one step produced for one request (deltas, not totals, except the counts)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    compute_s: float = 0.0  # the request's share of every step so far, by the tokens each step computed for it
    prompt_kv: Seq[bytearray] = ()  # RequestKV.export_prompt_from: the prompt's full blocks from there on


class EngineStats(NamedTuple):
    """The engine's load at one moment, as the services report it."""

    running: int
    waiting: int
    free_blocks: int
    total_blocks: int


class StepTiming(NamedTuple):
    """One engine step: when it ended, how long it took, how many sequences it advanced, how many of
    those were decoding (past their first token), how many KV blocks were in use after it, and how many
    tokens it computed (more than ``num_decoding``: prompt tokens shared the step)."""

    ended: float
    seconds: float
    num_outputs: int
    num_decoding: int = 0
    kv_blocks: int = 0
    num_tokens: int = 0

    @property
    def shared_with_prefill(self) -> bool:
        return self.num_tokens > self.num_decoding


class StageChunk(NamedTuple):
    """Run layers ``layers`` over tokens ``[start, start + len(token_ids))`` of request ``request_id``,
    whose prompt has ``prompt_len`` tokens. ``hidden`` (``[tokens, hidden_size]``) is the input of
    ``layers.start``; None when the stage starts at the embeddings (``layers.start == 0``).

    A request's first chunk may start after a reused prefix: ``prefix_token_ids`` (``start`` of them) and
    ``prefix_blocks``, pool payloads of those tokens (whole blocks, every layer; the stage loads its own)."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    layers: range
    hidden: torch.Tensor | None
    prompt_len: int
    params: SamplingParams
    prefix_token_ids: tuple[int, ...] = ()
    prefix_blocks: Seq[Payload] = ()


class StageResult(NamedTuple):
    """The stage's output: ``hidden`` for the next stage, or (the model's last layer, the prompt's last
    chunk) the first output token, its logprob, its text and why the output ends with it, if it does
    (``PREFILL_DONE`` when it goes on in decode)."""

    hidden: torch.Tensor | None
    token_id: int | None = None
    logprob: float | None = None
    text: str = ""
    finish_reason: str | None = None


def split_layers(num_layers: int, stages: int) -> tuple[int, ...]:
    """Boundaries of ``stages`` contiguous layer ranges as even as can be: stage ``s`` runs
    ``[bounds[s], bounds[s + 1])``."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    return tuple(math.floor(s * num_layers / stages) for s in range(stages + 1))


def hidden_bytes(hidden: torch.Tensor) -> bytes:
    """A stage's hidden states as raw bytes in the model's dtype (exact: the next stage sees the same values)."""
    return hidden.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def hidden_tensor(data: bytes, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`hidden_bytes`; ``tokens`` rows."""
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    if tokens < 1 or flat.numel() % tokens:
        raise InvalidRequestError(f"hidden states of {len(data)} bytes do not split into {tokens} rows")
    return flat.view(tokens, -1)


class Engine(ABC):
    """One model instance serving requests, driven from asyncio.

    Contract: calls take effect in the order they are made. ``generate`` yields the request's
    RequestOutputs as the engine produces them and ends after the finished one; an error adding the
    request (EngineError: a bad request, a bad ``RequestKV``) surfaces from the first ``anext``. A caller
    that stops iterating early must ``abort``. ``stats``, ``kv_spec``, ``layout``, ``model_name``,
    ``hidden_size``, ``dtype`` and ``cached_prefix_blocks`` answer at once, from any thread; the rest
    wait their turn with the engine's work.
    """

    pool_kv: bool = False
    """True for an engine whose workers move its KV themselves (vLLM with Halfmoon's KV connector): it looks
    the context's blocks up in the pool and loads them, and stores the full blocks it computes there, under
    the ``block_keys`` given to ``generate`` (the whole context's). Callers then pass no ``RequestKV``, store
    nothing for it, and hand a prefill over to decode through the pool alone; ``release``, ``export_kv`` and
    the pipeline stages are refused with EngineError."""

    paces_prompts: bool = False
    """True for an engine that honours ``generate``'s ``step_target_s`` (it sizes its own steps' prompt
    chunks); the conductor paces prompts only on instances that say so in their heartbeats."""

    @property
    @abstractmethod
    def kv_spec(self) -> KVSpec:
        """The KV identity every instance of the cluster must agree on (advertised in heartbeats)."""

    @property
    @abstractmethod
    def layout(self) -> BlockLayout:
        """The pool-format block layout of this engine's KV (unkeyed: callers add the cluster's MAC)."""

    @property
    @abstractmethod
    def model_name(self) -> str: ...

    @abstractmethod
    def stats(self) -> EngineStats:
        """The load after the engine's last step or command (a snapshot, never blocking)."""

    @abstractmethod
    def generate(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                 output_token_ids: Seq[int] = (), block_keys: Seq[bytes] = (), tenant_salt: str | None = None,
                 prefill_only: bool = False, kv: RequestKV = NO_KV,
                 step_target_s: float = 0.0) -> AsyncIterator[RequestOutput]:
        """Add a request and stream its outputs.

        ``output_token_ids`` continues a request whose first tokens were produced elsewhere (a prefill
        instance, an earlier attempt); they count towards ``max_tokens``. ``block_keys`` are the content
        keys of the prompt's full blocks: matching ones are reused from the local prefix cache, and
        computed ones are cached there. ``tenant_salt`` is the salt they were made with
        (``kv_spec.hasher(tenant_salt)``): an engine that stores in the pool itself (``pool_kv``) keys the blocks
        it generates past them with it; the others' services store those. ``prefill_only`` stops after the first sampled token
        (``PREFILL_DONE`` unless the output ends there) and keeps the KV until ``release``. ``kv`` is the
        KV the request loads and stores (``RequestKV``). ``step_target_s`` (0: none) paces the prompt: while
        other sequences decode, its chunks keep the steps they share within that many seconds, where the
        engine ``paces_prompts``; one that does not computes the prompt as it would any other."""

    @abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV; False when the engine does not know it."""

    @abstractmethod
    async def release(self, request_id: str) -> None:
        """Free the KV a finished prefill-only request kept; UnknownRequestError when it holds none."""

    @abstractmethod
    async def export_kv(self, request_id: str, first_block: int = 0, end_block: int | None = None) -> list[bytearray]:
        """Pool-format payloads (unsealed) of the request's computed KV in blocks ``first_block`` to
        ``end_block`` (exclusive; None: all), ``block_size`` tokens each, the last computed one possibly
        partial; fewer when fewer are computed now. UnknownRequestError when the request is gone."""

    @abstractmethod
    def cached_prefix_blocks(self, block_keys: Seq[bytes]) -> int:
        """How many leading blocks of ``block_keys`` the local prefix cache holds now. A hint: the engine
        reuses only what its cache still holds when it schedules the request."""

    @abstractmethod
    async def take_cache_events(self) -> tuple[list[bytes], list[bytes]]:
        """Keys stored in and evicted from the local prefix cache since the last call."""

    @abstractmethod
    async def cached_block_keys(self) -> list[bytes]:
        """Every key the local prefix cache holds (a snapshot for the conductor's index)."""

    # A pipeline stage (chunked pipeline-parallel prefill): a range of layers over a prompt, chunk by
    # chunk, with hidden states in and out.
    @property
    @abstractmethod
    def hidden_size(self) -> int: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The dtype of the hidden states a stage takes and gives."""

    @abstractmethod
    async def run_stage(self, chunk: StageChunk) -> StageResult:
        """Run one chunk of a request through a range of layers; chunks of a request come in order, from
        position 0 or after whole prefix blocks. EngineError when refused."""

    @abstractmethod
    async def stage_payloads(self, request_id: str, layers: range) -> list[bytearray]:
        """The stage's layers of every block the request computed here, in pool format (unsealed, the
        other layers zero)."""

    @abstractmethod
    async def release_stage(self, request_id: str) -> bool:
        """Free a stage's KV of the request; False when this engine holds none of it."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and wait for it (blocking; call it off the event loop)."""
