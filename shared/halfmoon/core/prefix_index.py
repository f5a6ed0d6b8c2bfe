"""The one prefix-index interface: which leading blocks of a key chain a cache holds.

Block keys are chained (a key commits to its whole prefix), so a prefix match is a walk along the
chain that ends at the first miss. Four places keep such an index: the engine's local prefix cache
(keys -> KV blocks in its paged cache), the pool index (keys -> replicas on transfer nodes), the
simulator's per-node caches, and the conductor's mirror of every prefill instance's cache. The first
three own their blocks and implement :class:`PrefixIndex`; the conductor's mirror only learns what the
instances store and evict, so it implements the read side, :class:`PrefixMatcher`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class PrefixMatcher(ABC, Generic[K]):
    """Read side. Contract: ``match`` is pure (no lock, no recency change)."""

    @abstractmethod
    def match(self, keys: Sequence[K]) -> int:
        """How many leading keys of the chain are held; the first miss ends the match."""


class PrefixIndex(PrefixMatcher[K]):
    """A cache that owns its blocks.

    Contract: ``insert`` caches a chain (keys already held are refreshed, as a hit would) and may
    evict unlocked blocks to make room, returning them; ``lock`` pins held keys against eviction
    until the same number of ``unlock`` calls; ``evict`` removes up to ``n`` unlocked keys in the
    cache's policy order and returns them. ``touch`` records a hit on held keys. ``now`` is any
    monotonic clock in seconds (the simulator passes simulated time; order-only caches ignore it).
    No I/O; not thread-safe.
    """

    @abstractmethod
    def lock(self, keys: Sequence[K]) -> None: ...

    @abstractmethod
    def unlock(self, keys: Sequence[K]) -> None: ...

    @abstractmethod
    def touch(self, keys: Sequence[K], now: float) -> None: ...

    @abstractmethod
    def insert(self, keys: Sequence[K], now: float) -> list[K]: ...

    @abstractmethod
    def evict(self, n: int, now: float) -> list[K]: ...


def match_chain(keys: Sequence[K], held: Callable[[K], bool]) -> int:
    """Leading keys for which ``held`` is true: the one prefix walk every index shares."""
    for position, key in enumerate(keys):
        if not held(key):
            return position
    return len(keys)
