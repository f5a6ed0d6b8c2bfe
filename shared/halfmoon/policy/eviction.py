"""Eviction policies for KVCache blocks: pure code shared by the cache-manager and the simulator."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)  # a tracked block's key


class EvictionPolicy(ABC, Generic[K]):
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
    def on_insert(self, key: K, *, now: float, chain_position: int = 0) -> None:
        """Start tracking ``key``; ``chain_position`` is the block's index in its prefix chain."""

    @abstractmethod
    def on_access(self, key: K, *, now: float) -> None:
        """Record a hit on a tracked key."""

    @abstractmethod
    def on_remove(self, key: K) -> None:
        """Stop tracking ``key`` (unknown keys are ignored)."""

    @abstractmethod
    def victims(self, n: int, protected: Callable[[K], bool] = lambda _k: False) -> list[K]:
        """Up to ``n`` unprotected keys, first to evict first."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __contains__(self, key: K) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def keys(self) -> Iterable[K]:  # pragma: no cover - overridden
        raise NotImplementedError


class _BucketedPolicy(EvictionPolicy[K]):
    """Keys grouped into integer buckets, each kept in recency order (oldest first).

    ``victims`` walks the buckets in ``_bucket_order`` and each bucket oldest first, so every
    concrete policy is "rank by bucket, break ties by least recent use". Cost per call is the
    number of buckets plus the keys walked, not the number tracked.
    """

    descending = False

    def __init__(self) -> None:
        self._where: dict[K, int] = {}
        self._buckets: dict[int, OrderedDict[K, None]] = {}

    def _initial_bucket(self, chain_position: int) -> int:
        return 0

    def _bucket_after_access(self, bucket: int) -> int:
        return bucket

    def _place(self, key: K, bucket: int) -> None:
        self._where[key] = bucket
        self._buckets.setdefault(bucket, OrderedDict())[key] = None

    def _unplace(self, key: K) -> int | None:
        bucket = self._where.pop(key, None)
        if bucket is not None:
            members = self._buckets[bucket]
            del members[key]
            if not members:
                del self._buckets[bucket]
        return bucket

    def on_insert(self, key: K, *, now: float, chain_position: int = 0) -> None:
        if key in self._where:
            self.on_access(key, now=now)
        else:
            self._place(key, self._initial_bucket(chain_position))

    def on_access(self, key: K, *, now: float) -> None:
        bucket = self._where.get(key)
        if bucket is None:
            return
        new_bucket = self._bucket_after_access(bucket)
        if new_bucket == bucket:
            self._buckets[bucket].move_to_end(key)
        else:
            self._unplace(key)
            self._place(key, new_bucket)

    def on_remove(self, key: K) -> None:
        self._unplace(key)

    def victims(self, n: int, protected: Callable[[K], bool] = lambda _k: False) -> list[K]:
        out: list[K] = []
        if n <= 0:
            return out
        for bucket in sorted(self._buckets, reverse=self.descending):
            for key in self._buckets[bucket]:
                if not protected(key):
                    out.append(key)
                    if len(out) == n:
                        return out
        return out

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: K) -> bool:
        return key in self._where

    def keys(self) -> Iterable[K]:
        return self._where.keys()


class LRUEviction(_BucketedPolicy[K]):
    """Least recently inserted-or-hit first (Mooncake Store's default)."""


class LFUEviction(_BucketedPolicy[K]):
    """Fewest hits first (insert counts as one use); ties go least recently used first."""

    def _initial_bucket(self, chain_position: int) -> int:
        return 1

    def _bucket_after_access(self, bucket: int) -> int:
        return bucket + 1


class LengthAwareEviction(_BucketedPolicy[K]):
    """Deepest prefix-chain position first; ties go least recently used first.

    A block at position i is reusable only by requests that also match blocks 0..i-1, so it
    is never hit more often than its ancestors, and evicting an ancestor first would strand
    its still-cached descendants (a prefix match stops at the first missing block).
    """

    descending = True

    def _initial_bucket(self, chain_position: int) -> int:
        if chain_position < 0:
            raise ValueError(f"chain_position must be >= 0, got {chain_position}")
        return chain_position


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUEviction,
    "lfu": LFUEviction,
    "length-aware": LengthAwareEviction,
}


def make_eviction(name: str) -> EvictionPolicy[K]:
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {sorted(EVICTION_POLICIES)}") from None


@dataclass(frozen=True)
class Watermarks:
    """Evict in bursts: once usage passes ``high`` of capacity, free down to ``low``."""

    high: float = 0.95
    low: float = 0.85

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= self.high <= 1.0:
            raise ValueError(f"need 0 <= low <= high <= 1, got low={self.low} high={self.high}")

    def excess(self, used: int, capacity: int) -> int:
        """How many blocks to evict now (0 while usage is at or under the high mark)."""
        if capacity < 0 or used < 0:
            raise ValueError(f"negative usage or capacity: used={used} capacity={capacity}")
        if used <= self.high * capacity:
            return 0
        return used - int(self.low * capacity)
