"""Which prefill instance holds which block in its local prefix cache, mirrored from KV events."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Hashable, Iterable, Iterator, Mapping, Sequence

from halfmoon.core.prefix_index import PrefixMatcher, match_chain


class LiveBlockIndex(Mapping[Hashable, Collection[str]], PrefixMatcher[bytes]):
    """A ``BlockIndex`` (block key -> holders) fed by stored/evicted events and snapshots.

    Contract: ``apply`` with ``snapshot=True`` replaces everything known of that instance;
    ``forget`` drops an instance that left; ``match`` counts the leading blocks some instance
    holds. A mirror of the instances' caches, not a cache: it never locks or evicts. Pure
    bookkeeping, no I/O.
    """

    def match(self, keys: Sequence[bytes]) -> int:
        return match_chain(keys, self._holders.__contains__)

    def __init__(self) -> None:
        self._holders: dict[Hashable, set[str]] = defaultdict(set)
        self._held: dict[str, set[bytes]] = defaultdict(set)

    def apply(self, instance: str, stored: Iterable[bytes], evicted: Iterable[bytes], snapshot: bool = False) -> None:
        if snapshot:
            self.forget(instance)
        for key in stored:
            self._holders[key].add(instance)
            self._held[instance].add(key)
        for key in evicted:
            self._drop(key, instance)

    def forget(self, instance: str) -> None:
        for key in self._held.pop(instance, set()):
            self._drop(key, instance, keep_held=True)

    def _drop(self, key: bytes, instance: str, keep_held: bool = False) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(instance)
            if not holders:
                del self._holders[key]
        if not keep_held:
            self._held[instance].discard(key)

    def blocks_of(self, instance: str) -> int:
        return len(self._held.get(instance, ()))

    def __getitem__(self, key: Hashable) -> Collection[str]:
        return self._holders.get(key, ())

    def get(self, key: Hashable, default=None):  # None for a block no one holds, where __getitem__ gives ()
        return self._holders.get(key, default)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._holders)

    def __len__(self) -> int:
        return len(self._holders)
