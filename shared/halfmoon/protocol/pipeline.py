"""Chunked pipeline-parallel prefill (CPP): one prompt chunk's hidden states from one stage to the next."""

from __future__ import annotations

from itertools import pairwise

from halfmoon.protocol.base import Message
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.subjects import check_token
from halfmoon.protocol.work import BlockLocation

SALT_BYTES = 16  # a block's header salt (core/block_format.py): every stage seals its layers under it
MESSAGE_OVERHEAD = 64 << 10  # bytes of a StageWork besides its hidden states (token ids, block locations)


def chunk_tokens(chunk_size: int, max_payload: int, hidden_bytes_per_token: int) -> int:
    """Tokens per pipelined chunk: ``chunk_size``, or fewer where their hidden states would not fit in one
    NATS message of ``max_payload`` bytes (so no chunk is ever split across messages)."""
    if min(chunk_size, hidden_bytes_per_token) < 1 or max_payload <= MESSAGE_OVERHEAD + hidden_bytes_per_token:
        raise ValueError(f"no chunk of {hidden_bytes_per_token}-byte rows fits a {max_payload}-byte message")
    return min(chunk_size, (max_payload - MESSAGE_OVERHEAD) // hidden_bytes_per_token)


class StageWork(Message, frozen=True, kw_only=True, tag="stage_work"):
    """Run stage ``stage`` of ``stages`` (instance ids, the head first: the prefill instance the request was
    submitted to) over chunk ``index``: tokens ``[start, start + len(token_ids))`` of a ``prompt_len``-token
    prompt. Stage ``s`` runs layers ``[layer_bounds[s], layer_bounds[s + 1])``; ``hidden`` is the output of
    the layer before (``len(token_ids)`` rows of ``hidden_size`` values in ``dtype``, raw little-endian).

    The first chunk (``index`` 0) starts after the prefix reused from the pool, if any: ``prefix_token_ids``
    (``start`` of them) and ``prefix``, where each of its blocks is (read under the head's lease; every stage
    loads its own layers of them).

    Chunks of a request arrive in order. A middle stage sends its output on to the next stage. The chunk
    that ends the prompt (``last``) also says where each block of the request is to be written
    (``block_indexes``/``blocks``: DRAM extents the head reserved with put_start, the partial last block
    under its one-off key) and the salt each block's header carries (``salts``): each stage writes and
    seals its own layers of those blocks, the head commits them once every stage answered.
    """

    request_id: str
    attempt: int = 0
    stages: tuple[str, ...]
    layer_bounds: tuple[int, ...]
    stage: int
    index: int
    start: int
    token_ids: tuple[int, ...]
    prompt_len: int
    hidden: bytes
    dtype: str
    sampling: SamplingParams
    deadline: float
    last: bool = False
    block_indexes: tuple[int, ...] = ()
    blocks: tuple[BlockLocation, ...] = ()
    salts: tuple[bytes, ...] = ()
    prefix: tuple[BlockLocation, ...] = ()
    prefix_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_token(self.request_id, "request_id")
        for stage in self.stages:
            check_token(stage, "stage instance")
        bounds = self.layer_bounds
        distinct = len(set(self.stages)) == len(self.stages) >= 2
        if not distinct or len(bounds) != len(self.stages) + 1 or bounds[0] != 0 or any(
                a >= b for a, b in pairwise(bounds)):
            raise ValueError(f"need >= 2 distinct stages, {len(self.stages) + 1} increasing layer bounds from 0, "
                             f"got {self.stages} and {bounds}")
        if not 1 <= self.stage < len(self.stages):
            raise ValueError(f"stage must be inside 1..{len(self.stages) - 1} (the head runs stage 0), "
                             f"got {self.stage}")
        if not self.token_ids or self.start < 0 or self.start + len(self.token_ids) > self.prompt_len:
            raise ValueError(f"chunk of {len(self.token_ids)} tokens at {self.start} is outside the "
                             f"{self.prompt_len}-token prompt")
        if (self.index == 0) != (self.start == len(self.prefix_token_ids)) or (self.index and self.prefix):
            raise ValueError("the first chunk, and only it, starts after the reused prefix's tokens")
        if self.last != (self.start + len(self.token_ids) == self.prompt_len) or not self.hidden:
            raise ValueError("last must be set exactly on the chunk that ends the prompt, and hidden is required")
        if not len(self.block_indexes) == len(self.blocks) == len(self.salts) or any(
                len(s) != SALT_BYTES for s in self.salts) or (self.blocks and not self.last):
            raise ValueError(f"one location and one {SALT_BYTES}-byte salt per block index, on the last chunk only")

    @property
    def layers(self) -> range:
        return range(self.layer_bounds[self.stage], self.layer_bounds[self.stage + 1])


class StageDone(Message, frozen=True, kw_only=True, tag="stage_done"):
    """A stage (and every stage after it) ran chunk ``index``. On the last chunk: the first output token
    (``token_id``, ``logprob``, its ``text`` and ``finish_reason``: ``prefill_done`` when decode goes on) and
    ``written``, the block indexes whose layers every stage from this one on wrote and sealed."""

    request_id: str
    index: int
    token_id: int | None = None
    logprob: float | None = None
    text: str = ""
    finish_reason: str | None = None
    written: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_token(self.request_id, "request_id")
