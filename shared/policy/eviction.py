"""Eviction policies for KVCache blocks: pure code shared by the cache-manager and the simulator."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable


class EvictionPolicy(ABC):
    """Orders cached blocks for eviction.

    Contract: the policy only ranks; it never removes a block by itself. The owner calls
    ``on_insert`` once per block it starts tracking, ``on_access`` on every hit,
    ``on_remove`` when the block leaves the tier for any reason, and ``victims`` when it
    needs room. ``victims`` returns up to ``n`` tracked keys in the order they should go,
    skipping every key for which ``protected(key)`` is true (leased or still being
    written); it does not forget them until ``on_remove``. ``now`` is any monotonic
    clock in seconds; the simulator passes simulated time.
    """

    @abstractmethod
    def on_insert(self, key: Hashable, *, now: float, chain_position: int = 0) -> None:
        """Start tracking ``key``; ``chain_position`` is the block's index in its prefix chain."""

    @abstractmethod
    def on_access(self, key: Hashable, *, now: float) -> None:
        """Record a hit on a tracked key."""

    @abstractmethod
    def on_remove(self, key: Hashable) -> None:
        """Stop tracking ``key`` (unknown keys are ignored)."""

    @abstractmethod
    def victims(self, n: int, protected: Callable[[Hashable], bool] = lambda _k: False) -> list[Hashable]:
        """Up to ``n`` unprotected keys, first to evict first."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __contains__(self, key: Hashable) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def keys(self) -> Iterable[Hashable]:  # pragma: no cover - overridden
        raise NotImplementedError
