"""How many prompt tokens a step may take so that the sequences decoding in it keep their TBT."""

from __future__ import annotations

import math


class StepBudget:
    """Sizes each step's prefill share to what a step-time target leaves after the decodes.

    Sarathi-Serve's stall-free batching with the budget learned rather than profiled: the step's
    time is read as (time of its decodes alone) + (prompt tokens) x (seconds per prompt token),
    both tracked as moving averages of the steps just taken, so they follow the batch and the
    context as they grow. While sequences decode, a step gets ``(target - decodes) / per_token``
    prompt tokens, never fewer than ``min_prefill_tokens`` (prompts keep moving even where the
    decodes alone overrun the target). Decodes alone are measured by a step without prompt tokens:
    one is taken when none was measured yet or ``probe_every`` steps have passed since, so the
    figure follows the batch even while prompts arrive all the time; until a step with prompt tokens
    was measured too, a step gets ``min_prefill_tokens`` of them. With nothing decoding, or no
    target, a step gets all of ``max_tokens``. ``target_s`` 0 turns it off for the engine's steps; the
    figures are learned all the same, for prompts paced to a target of their own
    (``prefill_tokens(..., target_s)``: a prompt the conductor admitted beside decoding sequences only on
    condition that its chunks keep their steps within that target). Such a prompt takes no probe: the
    other prompts of the step are not its to hold back, so with prompts arriving all the time the probe
    would never come and the paced prompt would wait for it; it goes by the decodes last measured alone,
    and by the floor until they are.
    """

    def __init__(self, target_s: float, max_tokens: int, min_prefill_tokens: int, *, smoothing: float = 0.3,
                 probe_every: int = 16) -> None:
        if not (math.isfinite(target_s) and target_s >= 0):
            raise ValueError(f"step time target must be a finite number >= 0, got {target_s}")
        if not 1 <= min_prefill_tokens <= max_tokens or not 0 < smoothing <= 1 or probe_every < 1:
            raise ValueError("need 1 <= min_prefill_tokens <= max_tokens, 0 < smoothing <= 1, probe_every >= 1")
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.min_prefill_tokens = min_prefill_tokens
        self._alpha = smoothing
        self._probe_every = probe_every
        self._since_probe = 0  # steps with decodes and prompt tokens since decodes alone were measured
        self.decode_s: float | None = None  # a step of decodes alone
        self.per_prompt_token_s: float | None = None

    def prefill_tokens(self, num_decoding: int, target_s: float | None = None) -> int:
        """Prompt tokens the next step may compute beside ``num_decoding`` decodes, to keep it within
        ``target_s`` (None: the engine's target)."""
        room = self.max_tokens - num_decoding
        target = self.target_s if target_s is None else target_s
        if not target or not num_decoding:
            return room
        if target_s is None and (self.decode_s is None or self._since_probe >= self._probe_every):
            return 0
        if self.decode_s is None or not self.per_prompt_token_s:
            return min(room, self.min_prefill_tokens)
        fits = int((target - self.decode_s) / self.per_prompt_token_s)
        return max(0, min(room, max(self.min_prefill_tokens, fits)))

    def record(self, num_decoding: int, num_prompt_tokens: int, seconds: float) -> None:
        """Learn from a step just taken: ``num_decoding`` decodes and ``num_prompt_tokens`` prompt tokens."""
        if not num_decoding or not (math.isfinite(seconds) and seconds >= 0):
            return
        if not num_prompt_tokens:
            self.decode_s = self._smooth(self.decode_s, seconds)
            self._since_probe = 0
            return
        self._since_probe += 1
        if self.decode_s is not None:
            per_token = max(seconds - self.decode_s, 0.0) / num_prompt_tokens
            if per_token > 0:
                self.per_prompt_token_s = self._smooth(self.per_prompt_token_s, per_token)

    def _smooth(self, average: float | None, value: float) -> float:
        return value if average is None else average + self._alpha * (value - average)
