"""What an engine instance's heartbeat says of its load: recent step timings turned into the figures the
conductor's placement and admission read."""

from __future__ import annotations

import collections
import time
from typing import NamedTuple

import numpy as np

from halfmoon.engine.interface import EngineStats, StepTiming
from halfmoon.policy.cost import weighted_median
from halfmoon.policy.state import RecentSamples
from halfmoon.protocol.registry import Load, StepSample

LOAD_WINDOW_S = 10.0  # heartbeats report the TTFT and TBT of this many seconds back
PACE_GAPS = 512  # the gaps a window of decoding steps reaches back to: one wave of 8 streams of 64 tokens
PACE_HISTORY_S = 60.0  # how far back it may reach


class StepWindow(NamedTuple):
    """``LoadMeter.window``: the window's steps as the gaps a decoding sequence saw (``sample``), and of
    ``sample.seconds``, what the prompt chunks sharing its steps added per gap (``prompt_s``)."""

    sample: StepSample
    prompt_s: float


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
        self._decoding: collections.deque[StepTiming] = collections.deque(maxlen=4096)  # those a window may reach

    def on_step(self, timing: StepTiming) -> None:
        if timing.num_outputs:
            self._step_s.add(timing.ended, timing.seconds)
        if timing.num_decoding:
            self._unreported.append(timing)
            self._decoding.append(timing)
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

    def window(self, now: float) -> StepWindow | None:
        """The decoding steps of the last window as the time between tokens a decoding sequence saw: the
        median of those that computed no prompt tokens, plus what those a prompt chunk shared took beyond it
        in the share of tokens they gave (None: none in the window). Each step counts once per sequence it
        advanced, as a stream's gaps do: a prompt chunk often shares a step with few decoders (it comes in
        when others have just finished), and counted per step its excess stood for half again the gaps the
        streams saw. The lower median, because one step stalled by something outside says nothing of the next
        ones (a decode instance stopped for 20 s woke with that step and one more in its window, whose midpoint
        predicted 10 s between tokens and had a migrated stream rejected); the shared steps' excess in full,
        because their length is the prompts' (a chunk of 2,048 tokens took 6 s where a decode-only step took
        0.15 s) and a stream's mean gap is that mix. One heartbeat's steps alone swung from 0.15 s to 6 s with
        whether a chunk fell in them.

        A window with steps in it reaches back (up to ``PACE_HISTORY_S``, and not across a window's length of
        idleness) to at least ``PACE_GAPS`` gaps and one decode-only step: a mean over fewer is the phase of a
        wave of requests, not the pace of their prompts, and without a decode-only step there is no level to
        tell the prompts' share from. Beside a busy loop, 8 streams' 512-token prompts took 10 s to compute;
        the 10-s window then held only the steps they shared (3.3 s each), and requests were turned away for
        a 3.3 s TBT while the streams decoded on at 0.15 s."""
        steps = self._decoding
        while steps and steps[0].ended < now - max(self._window_s, PACE_HISTORY_S):
            steps.popleft()
        history = tuple(steps)
        start = next((i for i, t in enumerate(history) if t.ended >= now - self._window_s), len(history))
        if start == len(history):
            return None
        gaps = sum(t.num_decoding for t in history[start:])
        has_alone = any(not t.shared_with_prefill for t in history[start:])
        while start > 0 and (gaps < PACE_GAPS or not has_alone) and not self._idle_before(history, start):
            start -= 1
            gaps += history[start].num_decoding
            has_alone = has_alone or not history[start].shared_with_prefill
        window = history[start:]
        alone = [t for t in window if not t.shared_with_prefill]
        shared = [t for t in window if t.shared_with_prefill]
        if alone:
            typical = weighted_median(np.array([t.seconds for t in alone]), np.array([t.num_decoding for t in alone]),
                                      lower=True)
            excess = max(0.0, sum(t.num_decoding * (t.seconds - typical) for t in shared)) / gaps
        else:
            typical, excess = sum(t.num_decoding * t.seconds for t in shared) / gaps, 0.0
        return StepWindow(StepSample(steps=len(window), batch=sum(t.num_decoding ** 2 for t in window) / gaps,
                                     kv_tokens=sum(t.num_decoding * t.kv_blocks for t in window) * self.block_size / gaps,
                                     seconds=typical + excess), excess)

    def _idle_before(self, history: tuple[StepTiming, ...], i: int) -> bool:
        """Whether the instance decoded nothing for a window's length before step ``i``: a window does not
        reach back across that, or a slow spell before it would come back with the first step after."""
        return history[i].ended - history[i].seconds - history[i - 1].ended > self._window_s

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
                    window_steps=None if window is None else window.sample,
                    window_prompt_s=0.0 if window is None else window.prompt_s)


def _mean(values: tuple[float, ...]) -> float | None:
    return sum(values) / len(values) if values else None


def _mean_ms(seconds: tuple[float, ...]) -> float | None:
    mean = _mean(seconds)
    return None if mean is None else mean * 1000
