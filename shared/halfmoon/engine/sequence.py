"""One request's state inside the engine, and the part of it one step computes."""

from __future__ import annotations

from enum import Enum, auto
from typing import NamedTuple

from halfmoon.engine.interface import LayerSource
from halfmoon.protocol.sampling import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids, how many of them have KV in the cache, and the blocks that hold it.

    ``token_ids`` is prompt + output. A step computes the slice
    ``[num_computed_tokens, num_computed_tokens + n)``; when that slice reaches the end
    of ``token_ids`` the step samples one more token.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival: int, output_token_ids: list[int] | None = None,
                 block_keys: tuple[bytes, ...] = (), seed: int = 0, num_prompt_tokens: int | None = None) -> None:
        self.request_id = request_id
        self.params = params
        # a pipeline stage's sequence starts with part of the prompt and gets the rest chunk by chunk
        self.num_prompt_tokens = len(prompt_token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self.token_ids: list[int] = list(prompt_token_ids) + list(output_token_ids or ())
        self.num_computed_tokens = 0
        self.compute_s = 0.0  # this sequence's share of the steps' time, by tokens computed
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_runs: list[list[int]] = []  # block_table as [first block, count] runs of consecutive ids
        self.block_keys = block_keys  # content keys of the prompt's full blocks, for the local prefix cache
        self.num_registered = 0  # leading full blocks already published to the local prefix cache
        self.kv_import: LayerSource | None = None  # KV fetched elsewhere, imported layer by layer
        self.kv_import_start = 0  # block index where kv_import begins
        self.kv_load_from: int | None = None  # token position to copy kv_import from, set at admission
        self.status = SequenceStatus.WAITING
        self.arrival = arrival
        self.finish_reason: str | None = None
        self.hold_kv = False
        self.step_target_s = 0.0  # while others decode, its prompt chunks keep their steps within this (0: no pace)
        self.output_logprobs: list[float] = []
        # Sampling draws from a stream keyed on (seed, position), so the same request resumed
        # at any position elsewhere samples what it would have sampled here.
        self.seed = params.seed if params.seed is not None else seed

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


class ScheduledChunk(NamedTuple):
    """``seq`` computes ``num_tokens`` tokens starting at ``start`` in this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        return self.start + self.num_tokens == self.seq.num_tokens
