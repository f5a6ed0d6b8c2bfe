"""Paged KV cache bookkeeping: a free list with reference counts, and block tables."""

from __future__ import annotations

from collections import deque

from shared.engine.sequence import Sequence


class BlockAllocator:
    """Hands out KV cache block ids; a block returns to the free list when its last reference goes.

    Reference counts let several sequences share a block (a common prefix) without copying.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        block = self._free.popleft()
        self._refs[block] = 1
        return block

    def share(self, block: int) -> None:
        assert self._refs[block] > 0, "sharing a free block"
        self._refs[block] += 1

    def release(self, block: int) -> None:
        assert self._refs[block] > 0, "double free of a KV block"
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)


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

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.allocator.release(block)
        seq.block_table.clear()

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
