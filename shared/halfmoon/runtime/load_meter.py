"""What an engine instance's heartbeat says of its load: recent step timings turned into the figures the
conductor's placement and admission read."""

from __future__ import annotations

import collections
import time

from halfmoon.engine.interface import EngineStats, StepTiming
from halfmoon.policy.state import RecentSamples
from halfmoon.policy.step_window import WINDOW_S, DecodingSteps, StepPace, forget_unreachable, step_pace
from halfmoon.protocol.registry import Load, StepSample

LOAD_WINDOW_S = WINDOW_S  # heartbeats report the TTFT and TBT of this many seconds back


class LoadMeter:
    """Recent step timings, turned into the load figures a heartbeat carries.

    ``on_step`` runs on the engine thread and ``load`` on the event loop: they share only deques,
    whose appends and pops are atomic (``RecentSamples`` is written for one writer and one reader)."""

    def __init__(self, block_size: int, window_s: float = LOAD_WINDOW_S) -> None:
        self.block_size = block_size
        self._ttft_s = RecentSamples(window_s)
        self._step_s = RecentSamples(window_s)
        self._shared = RecentSamples(window_s)  # 1.0 for each decoding step a prompt chunk shared, else 0.0
        self._unreported: collections.deque[StepTiming] = collections.deque(maxlen=4096)  # decoding steps
        self._window_s = window_s
        self._decoding: collections.deque[DecodingSteps] = collections.deque(maxlen=4096)  # those a window may reach

    def on_step(self, timing: StepTiming) -> None:
        if timing.num_outputs:
            self._step_s.add(timing.ended, timing.seconds)
        if timing.num_decoding:
            self._unreported.append(timing)
            self._decoding.append(DecodingSteps(timing.ended, timing.seconds, timing.num_decoding,
                                                timing.kv_blocks * self.block_size, timing.shared_with_prefill))
            self._shared.add(timing.ended, float(timing.shared_with_prefill))

    def take_steps(self) -> tuple[StepSample | None, StepSample | None]:
        """The steps since the last call that advanced a decoding sequence, averaged: those that computed
        no prompt tokens, and those a prefill chunk shared (None where there were none). Their seconds are
        the time between tokens the decoding sequences saw."""
        taken = []
        while self._unreported:
            taken.append(self._unreported.popleft())
        return (self._average([t for t in taken if not t.shared_with_prefill]),
                self._average([t for t in taken if t.shared_with_prefill]))

    def _average(self, steps: list[StepTiming]) -> StepSample | None:
        if not steps:
            return None
        n = len(steps)
        return StepSample(steps=n, batch=sum(t.num_decoding for t in steps) / n,
                          kv_tokens=sum(t.kv_blocks for t in steps) * self.block_size / n,
                          seconds=sum(t.seconds for t in steps) / n)

    def window(self, now: float) -> StepPace | None:
        """The pace of the decoding steps lately (``policy.step_window.step_pace``)."""
        forget_unreachable(self._decoding, now, self._window_s)
        return step_pace(tuple(self._decoding), now, self._window_s)

    def on_first_token(self, seconds: float, now: float | None = None) -> None:
        self._ttft_s.add(time.time() if now is None else now, seconds)

    def load(self, stats: EngineStats, in_flight: int, accepted_total: int, now: float | None = None) -> Load:
        """Running: sequences in the engine's batch; queued: every other request taken and not done
        (waiting in the engine, or still fetching its prefix). TTFT and TBT are means over the last
        window: an instance idle that long reports none, so a slow spell it had cannot keep the
        conductor's balance away from it after the spell ends."""
        now = time.time() if now is None else now
        window = self.window(now)
        return Load(queue_len=max(0, in_flight - stats.running), running=stats.running,
                    free_kv_blocks=stats.free_blocks, total_kv_blocks=stats.total_blocks,
                    ttft_ms=_mean_ms(self._ttft_s.values(now)), tbt_ms=_mean_ms(self._step_s.values(now)),
                    accepted_total=accepted_total, shared_step_fraction=_mean(self._shared.values(now)),
                    window_steps=None if window is None else StepSample(
                        steps=window.steps, batch=window.batch, kv_tokens=window.kv_tokens, seconds=window.seconds),
                    window_prompt_s=0.0 if window is None else window.prompt_s)


def _mean(values: tuple[float, ...]) -> float | None:
    return sum(values) / len(values) if values else None


def _mean_ms(seconds: tuple[float, ...]) -> float | None:
    mean = _mean(seconds)
    return None if mean is None else mean * 1000
