"""Block tables of sequences against one block pool, and the local prefix cache of full blocks
addressed by their chained content keys."""

from __future__ import annotations

from halfmoon.engine.block_pool import BlockPool
from halfmoon.engine.sequence import Sequence


class BlockManager:
    """Grows and frees the block tables of sequences.

    Besides ``block_table`` each sequence keeps ``block_runs``: its table as runs of
    consecutive block ids ``[first, count]``, which attention reads as single slices.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs so that ``num_tokens`` tokens have KV slots."""
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.pool.num_free

    def allocate_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` KV slots up to token ``num_tokens`` (the scheduler checked ``can_grow``).

        A sequence's tokens, as vLLM's ``KVCacheManager.allocate_slots`` lays them out::

            | comp | new_comp | ext_comp | new | (lookahead: none here)
            0      ^          ^          ^     ^ num_tokens = num_computed_tokens + this step's chunk
                   |          |          num_computed_tokens at admission
                   |          end of the local prefix-cache hit (reuse_prefix: shared blocks)
                   end of what this sequence computed before (0 at admission)

        ``comp`` and ``new_comp`` already have blocks (own, or shared from the prefix cache).
        ``ext_comp`` is KV imported from the pool (``add_request(kv=RequestKV(source=...))``): it gets its
        slots here together with ``new`` and the engine copies it in before the step computes
        ``new``; it is counted as computed, never recomputed. Blocks are only ever appended.
        """
        needed = self.blocks_needed(seq, num_tokens)
        if needed:
            last = seq.block_table[-1] if seq.block_table else None
            for block in self.pool.allocate(needed, after=last):
                self._append(seq, block)

    @staticmethod
    def _append(seq: Sequence, block: int) -> None:
        seq.block_table.append(block)
        runs = seq.block_runs
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1][1] += 1
        else:
            runs.append([block, 1])

    def reuse_prefix(self, seq: Sequence) -> int:
        """Share the longest locally cached prefix of ``seq``'s block keys; returns its blocks.

        The last prompt token is never covered: its logits give the next token.
        """
        keys = seq.block_keys[: (seq.num_tokens - 1) // self.block_size]
        matched = keys[: self.pool.match(keys)]
        self.pool.lock(matched)
        for key in matched:
            self._append(seq, self.pool.cached[key])
        seq.num_registered = len(matched)
        return len(matched)

    def register_computed(self, seq: Sequence) -> None:
        """Publish the full blocks ``seq`` has computed so far to the local prefix cache."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_keys))
        for index in range(seq.num_registered, full):
            self.pool.register(seq.block_keys[index], seq.block_table[index])
        seq.num_registered = max(seq.num_registered, full)

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.pool.release(block)
        seq.block_table.clear()
        seq.block_runs.clear()
        seq.num_registered = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
