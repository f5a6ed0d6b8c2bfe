"""The context limit of a model, one rule for the engine that enforces it and the gateway that checks it."""

from __future__ import annotations

from typing import Any


def context_limit(model_config: Any, max_model_len: int = 0) -> int:
    """The most tokens one sequence may hold (prompt + max_tokens): the model's positions, its sliding
    window and ``max_model_len`` (0: none), whichever is least. ``model_config`` is a transformers config."""
    positions = int(getattr(model_config, "max_position_embeddings", 0) or 0)
    limits = [n for n in (positions, getattr(model_config, "sliding_window", None), max_model_len) if n]
    if not limits:
        raise ValueError("cannot tell the model's context length (set max_model_len)")
    return int(min(limits))
