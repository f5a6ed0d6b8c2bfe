"""Per-layer hooks: load and store KV layer by layer while the model computes."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from halfmoon.engine.attention import PagedKVCache
from halfmoon.engine.sequence import ScheduledChunk


class LayerHook:
    """Called by the model runner around every decoder layer of every step.

    ``before_layer`` returns once the cached-prefix KV of ``layer`` that the step's chunks
    attend to is in ``cache`` (a streaming loader waits for that layer here, so later
    layers keep loading while this one computes). ``after_layer`` runs once the chunks'
    new KV of ``layer`` is in ``cache`` (a streaming writer copies it out here). Both
    default to doing nothing; a hook must not change block tables.
    """

    def idle(self, chunks: Seq[ScheduledChunk]) -> bool:
        """True when neither call would do anything for ``chunks``: the step's layers may run without them."""
        return True

    def before_layer(self, layer: int, chunks: Seq[ScheduledChunk], cache: PagedKVCache) -> None:
        return None

    def after_layer(self, layer: int, chunks: Seq[ScheduledChunk], cache: PagedKVCache) -> None:
        return None


class LayerHooks(LayerHook):
    """Several hooks, called in order around each layer."""

    def __init__(self, *hooks: LayerHook) -> None:
        self.hooks = hooks

    def idle(self, chunks: Seq[ScheduledChunk]) -> bool:
        return all(hook.idle(chunks) for hook in self.hooks)

    def before_layer(self, layer: int, chunks: Seq[ScheduledChunk], cache: PagedKVCache) -> None:
        for hook in self.hooks:
            hook.before_layer(layer, chunks, cache)

    def after_layer(self, layer: int, chunks: Seq[ScheduledChunk], cache: PagedKVCache) -> None:
        for hook in self.hooks:
            hook.after_layer(layer, chunks, cache)
