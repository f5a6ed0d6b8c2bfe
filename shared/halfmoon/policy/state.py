"""Snapshots of instance state that the live conductor and the simulator both fill.

Policies read these and nothing else, so the same decision code runs against a live cluster
and against simulated nodes. Locally cached blocks are not copied into each snapshot: the
owner passes one ``BlockIndex`` (block key -> ids of the prefill instances holding it), which
is what the cache-manager's lookup returns and what the simulator maintains incrementally.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from halfmoon.core.prefix_index import match_chain

BlockIndex = Mapping[Hashable, Collection[str]]


@dataclass(frozen=True)
class SLO:
    """Latency objectives: TTFT in seconds, TBT (mean of the slowest 10% of intervals) in seconds."""

    ttft_s: float = 30.0
    tbt_s: float = 0.1

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tbt_s > 0):
            raise ValueError(f"SLO thresholds must be positive, got ttft={self.ttft_s} tbt={self.tbt_s}")


# The services' SLOs unless HALFMOON_TTFT_SLO_S / HALFMOON_TBT_SLO_S say otherwise: the conductor admits
# to them and engines with TBT chunking size their steps to the TBT one, so both read it from here.
SERVING_SLO = SLO(ttft_s=30.0, tbt_s=0.2)


class RouteRequest(NamedTuple):
    """What the conductor knows about a request when it routes it (``max_tokens`` 0: not known).
    ``admitted``: it was admitted before and continues elsewhere (a migration): it is placed on the best
    instance whatever the predictions say, for rejecting it now would throw away what it has delivered.
    ``waited_s``: seconds it has already waited for a placement, part of its TTFT."""

    block_keys: tuple[Hashable, ...]
    prompt_tokens: int
    block_size: int
    max_tokens: int = 0
    admitted: bool = False
    waited_s: float = 0.0

    def cached_tokens(self, blocks: int) -> int:
        """Tokens covered by a matched prefix of ``blocks`` blocks; one token is always computed."""
        return min(blocks * self.block_size, self.prompt_tokens - 1) if self.prompt_tokens > 0 else 0


class PrefillInstanceState(NamedTuple):
    id: str
    queue_seconds: float
    queue_tokens: int = 0
    recent_ttft: tuple[float, ...] = ()


class DecodeWork(NamedTuple):
    """One request on (or heading to) a decode instance, with the owner's expected times."""

    context_tokens: int
    starts_at: float
    ends_at: float


class MeasuredStep(NamedTuple):
    """What an instance's recent decoding steps took: ``seconds`` each, advancing ``batch`` sequences
    over ``context_tokens`` of KV (averages)."""

    batch: float
    context_tokens: float
    seconds: float


class DecodeInstanceState(NamedTuple):
    """``batch_size``/``context_tokens`` describe the running batch now; ``work`` lists running and
    incoming requests with expected start/end times, for predicting the load at a later moment.
    ``work=None``: the owner cannot tell when work ends (a live conductor knows only the batch
    now), so the load now stands for the load later. ``interleaves_prefill``: the instance also
    prefills what it decodes (aggregated), in chunks that share its decoding steps.
    ``measured`` / ``measured_shared``: the instance's latest decoding steps without and with a prefill
    chunk in them (None: none lately), which set the level of its predictions. ``shared_step_fraction``: of
    its recent decoding steps, the share a prefill chunk shared (None: not measured). ``queued_prefill_s``: an
    aggregated instance's prompt work placed there and not yet computed, in seconds; its chunks will share
    the steps of everything decoding there meanwhile. ``decoders_tokens``: the mean ``max_tokens`` of the
    requests placed there (0: not known), the tokens its decoding sequences spread that work over.
    ``prompt_excess_s``: of ``measured.seconds``, what the prompt chunks sharing those steps added per gap (an
    aggregated instance measured as one window of both kinds of steps): a rejection names it, and a request
    kept out by it waits for it to pass. ``paces_prompts``: its engine paces a prompt's chunks to a step
    target of the request's own (``SloAwareDecode.paced``); ``paced_prefill_s``: of ``queued_prefill_s``, the
    work of prompts admitted so, which shares the decoding sequences' steps only as far as its target lets it."""

    id: str
    batch_size: int
    context_tokens: int
    capacity_tokens: int
    recent_tbt: tuple[float, ...] = ()
    work: tuple[DecodeWork, ...] | None = None
    interleaves_prefill: bool = False
    measured: MeasuredStep | None = None
    measured_shared: MeasuredStep | None = None
    shared_step_fraction: float | None = None
    queued_prefill_s: float = 0.0
    decoders_tokens: float = 0.0
    prompt_excess_s: float = 0.0
    paces_prompts: bool = False
    paced_prefill_s: float = 0.0


    def load_at(self, t: float) -> tuple[int, int]:
        """(batch size, context tokens) of the work expected to be running at time ``t``."""
        if self.work is None:
            return self.batch_size, self.context_tokens
        batch = context = 0
        for w in self.work:
            if w.starts_at <= t < w.ends_at:
                batch += 1
                context += w.context_tokens
        return batch, context

    def earliest_end_after(self, t: float) -> float | None:
        ends = [w.ends_at for w in self.work or () if w.ends_at > t]
        return min(ends) if ends else None


RECENT_WINDOW_S = 60.0


class RecentSamples:
    """Latency samples of the last ``window_s`` seconds: SLO attainment must forget, or an
    instance that once violated is avoided forever and never gets the samples to recover.

    One thread may ``add`` while another reads ``values``: appends and left pops of a deque are
    atomic, only the reader pops, and it copies the deque in one call before reading it."""

    __slots__ = ("_items", "window_s")

    def __init__(self, window_s: float = RECENT_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float) -> None:
        self._items.append((t, value))

    def values(self, now: float) -> tuple[float, ...]:
        items = self._items
        while items and items[0][0] < now - self.window_s:
            items.popleft()
        return tuple(v for _, v in tuple(items))


def slo_attainment(samples: Sequence[float], threshold: float) -> float:
    """Share of recent samples within ``threshold``; 1.0 when there is no evidence of load."""
    if not samples:
        return 1.0
    return sum(1 for s in samples if s <= threshold) / len(samples)


def prefix_lengths(keys: Sequence[Hashable], index: BlockIndex, ids: Collection[str]) -> dict[str, int]:
    """Matched prefix length in blocks for each instance id (absent ids matched nothing).

    Walks the chain once, intersecting holder sets, so the cost is the total number of
    holders met along the matched prefix rather than instances x blocks.
    """
    lengths: dict[str, int] = {}
    alive = set(ids)
    for i, key in enumerate(keys):
        holders = index.get(key)
        survivors = alive.intersection(holders) if holders else set()
        if len(survivors) < len(alive):
            for gone in alive - survivors:
                lengths[gone] = i
            alive = survivors
        if not alive:
            return lengths
    for inst in alive:
        lengths[inst] = len(keys)
    return lengths


def pool_prefix_length(keys: Sequence[Hashable], index: BlockIndex) -> int:
    """Blocks of the longest prefix that the pool holds somewhere (any holder per block)."""
    return match_chain(keys, lambda key: bool(index.get(key)))
