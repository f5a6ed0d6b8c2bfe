"""Paged KV cache bookkeeping: a free list with reference counts, block tables, and a local
prefix cache of full blocks addressed by their chained content keys."""

from __future__ import annotations

from collections import OrderedDict, deque

from halfmoon.engine.sequence import Sequence


class BlockAllocator:
    """Hands out KV cache block ids with reference counts.

    A block whose last reference goes returns to the free list, unless it holds a cached
    full block (it has a content key): then it stays readable in an LRU of evictable blocks
    until a new allocation needs the room. ``stored``/``evicted`` collect key events for
    whoever mirrors this cache (the conductor's block index).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self.stored: list[bytes] = []
        self.evicted: list[bytes] = []

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            key = self._key_of.pop(block)
            del self.cached[key]
            self.evicted.append(key)
        self._refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def release(self, block: int) -> None:
        assert self._refs[block] > 0, "double free of a KV block"
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def register(self, key: bytes, block: int) -> None:
        """Mark ``block`` as holding the full block ``key`` (first writer wins)."""
        if key not in self.cached and block not in self._key_of:
            self.cached[key] = block
            self._key_of[block] = key
            self.stored.append(key)


class BlockManager:
    """Grows and frees the block tables of sequences against one allocator."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs so that ``num_tokens`` tokens have KV slots."""
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.allocator.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self.allocator.allocate())

    def reuse_prefix(self, seq: Sequence) -> int:
        """Share the longest locally cached prefix of ``seq``'s block keys; returns its blocks.

        The last prompt token is never covered: its logits give the next token.
        """
        limit = (seq.num_tokens - 1) // self.block_size
        matched = 0
        for key in seq.block_keys[:limit]:
            block = self.allocator.cached.get(key)
            if block is None:
                break
            self.allocator.share(block)
            seq.block_table.append(block)
            matched += 1
        seq.num_registered = matched
        return matched

    def register_computed(self, seq: Sequence) -> None:
        """Publish the full blocks ``seq`` has computed so far to the local prefix cache."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_keys))
        for index in range(seq.num_registered, full):
            self.allocator.register(seq.block_keys[index], seq.block_table[index])
        seq.num_registered = max(seq.num_registered, full)

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.allocator.release(block)
        seq.block_table.clear()
        seq.num_registered = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
