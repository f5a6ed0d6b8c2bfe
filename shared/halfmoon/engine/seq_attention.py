"""What one sequence reads in a step's attention: shared by the SDPA path and the decode kernel."""

from __future__ import annotations

from typing import NamedTuple

import torch


class SeqAttention(NamedTuple):
    """One sequence's share of a step.

    Its queries are rows ``[query_start, query_start + query_len)`` of the step; its keys are
    the cache slots ``spans`` (half-open ranges, in position order), the last ``query_len`` of
    them its own new tokens. ``mask`` is ``[query_len, context]`` when earlier context is
    cached (the causal diagonal is offset); None means plain causal (or one decode query).
    """

    query_start: int
    query_len: int
    spans: tuple[tuple[int, int], ...]
    mask: torch.Tensor | None
