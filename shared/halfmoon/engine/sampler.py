"""Token selection per request: greedy, temperature, top-k, top-p, seeded generators."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch
from halfmoon.engine.sequence import Sequence


class Sampled(NamedTuple):
    token_ids: list[int]
    logprobs: list[float]


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        drop = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


class Sampler:
    """Picks one token per row of ``logits``; unseeded requests share the engine's generator."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> Sampled:
        logits = logits.cpu()
        logprobs = torch.log_softmax(logits, dim=-1)
        greedy = logits.argmax(dim=-1)
        tokens: list[int] = []
        for row, seq in enumerate(seqs):
            params = seq.params
            if params.greedy:
                tokens.append(int(greedy[row]))
                continue
            scaled = _filter(logits[row] / params.temperature, params.top_k, params.top_p)
            probs = torch.softmax(scaled, dim=-1)
            if not bool(torch.isfinite(probs).all()):
                # A temperature so close to 0 that the logits overflow: its limit is greedy.
                tokens.append(int(greedy[row]))
                continue
            tokens.append(int(torch.multinomial(probs, 1, generator=seq.generator or self.generator)))
        chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)]
        return Sampled(tokens, chosen.tolist())
