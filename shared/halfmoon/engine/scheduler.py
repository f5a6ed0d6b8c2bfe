"""Continuous batching: which sequences compute how many tokens in the next step."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from halfmoon.engine.block_manager import BlockManager
from halfmoon.engine.sequence import ScheduledChunk, Sequence, SequenceStatus
from halfmoon.engine.step_budget import StepBudget


class StepShape(NamedTuple):
    """What a scheduled step computes: its decodes and its prompt tokens."""

    num_decoding: int
    num_prompt_tokens: int


class Scheduler:
    """Decoding sequences first, then unfinished prefills, then waiting ones.

    Every step spends at most ``max_num_batched_tokens`` tokens; a single prefill takes at
    most ``chunk_size`` of them, so long prompts interleave with decodes. Prompt tokens get what
    ``step_budget`` leaves them beside the step's decodes (all the rest, unless it keeps steps to
    a TBT target). A prompt paced to a target of its own (``Sequence.step_target_s``) takes, while
    sequences decode, only what keeps the step within that target with the prompt tokens scheduled
    before it; it waits its turn in line where nothing is left. When a sequence cannot get a block, the most recently admitted running
    sequence is preempted, unless it is already in this step: its blocks are freed and it goes
    back to the head of the queue to be recomputed.
    """

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunk_size: int, step_budget: StepBudget | None = None) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size
        self.step_budget = step_budget or StepBudget(0.0, max_num_batched_tokens, 1)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._preempted_this_step = False
        self.last_step = StepShape(0, 0)  # the step last scheduled

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        self._preempted_this_step = False
        chunks: list[ScheduledChunk] = []
        decoding = [seq for seq in self.running if seq.num_uncomputed == 1]
        for seq in decoding[:self.max_num_batched_tokens]:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted to make room for an earlier one
            if not self._make_room(seq, seq.num_computed_tokens + 1, chunks):
                break
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
        num_decoding = len(chunks)
        budget = min(self.step_budget.prefill_tokens(num_decoding), self.max_num_batched_tokens - num_decoding)
        for seq in [seq for seq in self.running if seq.num_uncomputed > 1]:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            n = self._chunk(seq, budget, chunks, num_decoding)
            if n <= 0:
                continue
            if not self._make_room(seq, seq.num_computed_tokens + n, chunks):
                break
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        # Admitting right after a preemption would only thrash the blocks just freed.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not self._preempted_this_step:
            seq = self.waiting[0]
            if not seq.block_table:
                self._reuse(seq)
            n = self._chunk(seq, budget, chunks, num_decoding)
            if n <= 0:
                break
            if not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                self.blocks.free(seq)  # give the shared prefix back until there is room
                seq.num_computed_tokens, seq.kv_load_from = 0, None
                break
            self.blocks.allocate_slots(seq, seq.num_computed_tokens + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        self.last_step = StepShape(num_decoding, sum(c.num_tokens for c in chunks) - num_decoding)
        return chunks

    def _chunk(self, seq: Sequence, budget: int, scheduled: list[ScheduledChunk], num_decoding: int) -> int:
        """The prompt tokens ``seq`` computes in this step, given ``budget`` left of it and the chunks
        ``scheduled`` so far (the first ``num_decoding`` of them decodes)."""
        n = min(seq.num_uncomputed, budget, self.chunk_size)
        if seq.step_target_s and num_decoding:
            taken = sum(chunk.num_tokens for chunk in scheduled[num_decoding:])
            n = min(n, self.step_budget.prefill_tokens(num_decoding, seq.step_target_s) - taken)
        return n

    def record_step_time(self, seconds: float) -> None:
        """How long the step last scheduled took, for the budget of the next ones."""
        self.step_budget.record(*self.last_step, seconds)

    def _reuse(self, seq: Sequence) -> None:
        """Start ``seq`` after its locally cached prefix, extended by KV imported for it."""
        size = self.blocks.block_size
        covered = self.blocks.reuse_prefix(seq) * size
        if seq.kv_import is not None and seq.kv_import_start * size <= covered:
            end = seq.kv_import_start * size + seq.kv_import.num_tokens
            if end > covered:
                seq.kv_load_from, covered = covered, end
        seq.num_computed_tokens = covered
        seq.num_cached_tokens = max(seq.num_cached_tokens, covered)

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: list[ScheduledChunk]) -> bool:
        """Grow ``seq`` to ``num_tokens`` slots, preempting later sequences not in ``scheduled``; False if
        ``seq`` itself went or the next to go is already scheduled."""
        while not self.blocks.can_grow(seq, num_tokens):
            victim = self.running[-1]
            if any(chunk.seq is victim for chunk in scheduled):
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.allocate_slots(seq, num_tokens)
        return True

    def recompute(self, seq: Sequence) -> None:
        """Start a running ``seq`` over, first in line (its imported KV did not all arrive)."""
        self._preempt(seq)
        self.num_preemptions -= 1  # not for want of room
        seq.num_cached_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self._preempted_this_step = True

    def finish(self, seq: Sequence) -> None:
        """Take a finished sequence out of the batch; its blocks stay if it holds its KV."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        if not seq.hold_kv:
            self.blocks.free(seq)
