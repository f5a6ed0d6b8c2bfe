"""KV cache blocks: one state object per block, a contiguity-seeking allocator and typed cache events."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from halfmoon.core.prefix_index import PrefixIndex, match_chain

_FREE, _TAKEN = 1, 0
_FREE_RUNS = re.compile(b"\x01+")


@dataclass(slots=True)
class Block:
    """One KV cache block: who uses it, and which full block of content it holds, if any."""

    id: int
    ref_count: int = 0
    key: bytes | None = None  # chained content key once the block is full and published
    num_tokens: int = 0  # rows written so far (block_size once full)


class BlockStored(NamedTuple):
    """Keys that entered the local prefix cache."""

    keys: list[bytes]


class BlockRemoved(NamedTuple):
    """Keys that left the local prefix cache (their blocks were reused)."""

    keys: list[bytes]


CacheEvent = BlockStored | BlockRemoved


class BlockPool(PrefixIndex[bytes]):
    """Hands out KV cache blocks with reference counts; keeps released full blocks as a prefix cache.

    A block whose last reference goes returns to the free set, unless it holds a cached full
    block (it has a key): then it stays readable in an LRU of evictable blocks until an
    allocation finds no free block. Allocation keeps a sequence's blocks consecutive where
    it can (attention then reads them as one slice of the cache, without a copy): it extends
    the sequence's last block, and starts new runs in the middle of the largest free gap so
    that the neighbours on both sides have room to grow.

    As a :class:`PrefixIndex` over content keys: ``lock`` is a reference on the key's block,
    eviction order is least recently released (or touched) first. A key enters with its block
    through ``register`` once the block's KV is computed; ``insert``, which carries no block,
    only refreshes keys already held.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free = bytearray([_FREE]) * num_blocks  # byte i is 1 while block i is free (no refs, no key)
        self._num_free = num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[bytes, int] = {}
        self._events: list[CacheEvent] = []

    @property
    def num_free(self) -> int:
        return self._num_free + len(self._evictable)

    def take_events(self) -> list[CacheEvent]:
        """Cache events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """``count`` blocks, consecutive to block ``after`` and to each other where the free set allows."""
        assert count <= self.num_free, "allocation beyond the free blocks"
        out: list[int] = []
        nxt = None if after is None else after + 1
        while len(out) < count:
            if nxt is None or nxt >= self.num_blocks or not self._free[nxt]:
                nxt = self._run_start(count - len(out))
            if nxt is None:
                out.append(self._evict())
                continue
            self._take(nxt)
            out.append(nxt)
            nxt += 1
        return out

    def _run_start(self, want: int) -> int | None:
        """Where a new run of ``want`` blocks goes: centred in the largest free gap (None: no free block)."""
        if not self._num_free:
            return None
        best = max(_FREE_RUNS.finditer(self._free), key=lambda m: m.end() - m.start())
        start, size = best.start(), best.end() - best.start()
        # A gap at the very start has no left neighbour to leave room for.
        return start if start == 0 or size <= want else start + (size - want) // 2

    def _take(self, index: int) -> None:
        self._free[index] = _TAKEN
        self._num_free -= 1
        self.blocks[index].ref_count = 1

    def _evict(self) -> int:
        """Take the least recently used evictable block for a new owner."""
        index, _ = self._evictable.popitem(last=False)
        self._forget(index)
        self.blocks[index].ref_count = 1
        return index

    def _forget(self, index: int) -> bytes:
        block = self.blocks[index]
        key = block.key
        assert key is not None
        del self.cached[key]
        self._events.append(BlockRemoved([key]))
        block.key, block.num_tokens = None, 0
        return key

    # ---------------------------------------------------------------- PrefixIndex
    def match(self, keys: Sequence[bytes]) -> int:
        return match_chain(keys, self.cached.__contains__)

    def lock(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.share(self.cached[key])

    def unlock(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.release(self.cached[key])

    def touch(self, keys: Sequence[bytes], now: float = 0.0) -> None:
        for key in keys:
            index = self.cached.get(key)
            if index is not None and index in self._evictable:
                self._evictable.move_to_end(index)

    def insert(self, keys: Sequence[bytes], now: float = 0.0) -> list[bytes]:
        self.touch(keys, now)
        return []

    def evict(self, n: int, now: float = 0.0) -> list[bytes]:
        out: list[bytes] = []
        while self._evictable and len(out) < n:
            index, _ = self._evictable.popitem(last=False)
            out.append(self._forget(index))
            self._free[index] = _FREE
            self._num_free += 1
        return out

    def share(self, index: int) -> None:
        block = self.blocks[index]
        if block.ref_count == 0:
            del self._evictable[index]
        block.ref_count += 1

    def release(self, index: int) -> None:
        block = self.blocks[index]
        assert block.ref_count > 0, "double free of a KV block"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.key is not None:
                self._evictable[index] = None
            else:
                block.num_tokens = 0
                self._free[index] = _FREE
                self._num_free += 1

    def register(self, key: bytes, index: int) -> None:
        """Mark block ``index`` as holding the full block ``key`` (first writer wins)."""
        block = self.blocks[index]
        if key not in self.cached and block.key is None:
            self.cached[key] = index
            block.key = key
            self._events.append(BlockStored([key]))
