"""The pace of an instance's decoding steps lately, as the gaps its decoding sequences saw: what its TBT
predictions start from. An engine's heartbeat computes it from the steps it ran (``runtime.load_meter``);
the simulator from the steps its nodes would have run (``sim.batch``). One rule for both."""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from halfmoon.policy.cost import weighted_median

WINDOW_S = 10.0  # a window reaches this many seconds back at least
PACE_GAPS = 512  # and back to this many gaps: one wave of 8 streams of 64 tokens
PACE_HISTORY_S = 60.0  # but never further than this


class DecodingSteps(NamedTuple):
    """``steps`` steps in a row, the last ending at ``ended``, each advancing ``decoding`` sequences past their
    first token over ``kv_tokens`` of KV and taking ``seconds`` (means); ``shared``: prompt tokens shared them."""

    ended: float
    seconds: float
    decoding: int
    kv_tokens: float
    shared: bool
    steps: int = 1

    @property
    def started(self) -> float:
        return self.ended - self.seconds * self.steps


ENDED = attrgetter("ended")


class StepPace(NamedTuple):
    """A window's steps as the gaps a decoding sequence saw: ``steps`` steps advancing ``batch`` sequences over
    ``kv_tokens`` each (means over the gaps) and ``seconds`` between tokens, of which ``prompt_s`` is what the
    prompt chunks sharing those steps added."""

    steps: int
    batch: float
    kv_tokens: float
    seconds: float
    prompt_s: float


def step_pace(history: Sequence[DecodingSteps], now: float, window_s: float = WINDOW_S) -> StepPace | None:
    """The decoding steps of the last ``window_s`` (``history`` in the order they ran, each advancing at least
    one decoding sequence) as the time between tokens a decoding sequence saw: the median of those that
    computed no prompt tokens, plus what those a prompt chunk shared took beyond it in the share of tokens
    they gave (None: none in the window). Each step counts once per sequence it advanced, as a stream's gaps
    do: a prompt chunk often shares a step with few decoders (it comes in when others have just finished),
    and counted per step its excess stood for half again the gaps the streams saw. The lower median, because
    one step stalled by something outside says nothing of the next ones (a decode instance stopped for 20 s
    woke with that step and one more in its window, whose midpoint predicted 10 s between tokens and had a
    migrated stream rejected); the shared steps' excess in full, because their length is the prompts' (a
    chunk of 2,048 tokens took 6 s where a decode-only step took 0.15 s) and a stream's mean gap is that mix.
    One heartbeat's steps alone swung from 0.15 s to 6 s with whether a chunk fell in them.

    A window with steps in it reaches back (up to ``PACE_HISTORY_S``, and not across a window's length of
    idleness) to at least ``PACE_GAPS`` gaps and one decode-only step: a mean over fewer is the phase of a
    wave of requests, not the pace of their prompts, and without a decode-only step there is no level to
    tell the prompts' share from. Beside a busy loop, 8 streams' 512-token prompts took 10 s to compute;
    the 10-s window then held only the steps they shared (3.3 s each), and requests were turned away for
    a 3.3 s TBT while the streams decoded on at 0.15 s. It stays the same until new steps come or ``now``
    passes ``pace_changes_after``."""
    oldest = bisect_left(history, now - max(window_s, PACE_HISTORY_S), key=ENDED)
    start = bisect_left(history, now - window_s, oldest, key=ENDED)
    if start == len(history):
        return None
    gaps = sum(s.decoding * s.steps for s in history[start:])
    has_alone = any(not s.shared for s in history[start:])
    while (start > oldest and (gaps < PACE_GAPS or not has_alone)
           and history[start].started - history[start - 1].ended <= window_s):
        start -= 1
        gaps += history[start].decoding * history[start].steps
        has_alone = has_alone or not history[start].shared
    window = history[start:]
    alone = [s for s in window if not s.shared]
    if alone:
        typical = weighted_median(np.array([s.seconds for s in alone]),
                                  np.array([s.decoding * s.steps for s in alone]), lower=True)
        excess = max(0.0, sum(s.decoding * s.steps * (s.seconds - typical) for s in window if s.shared)) / gaps
    else:
        typical, excess = sum(s.decoding * s.steps * s.seconds for s in window) / gaps, 0.0
    return StepPace(steps=sum(s.steps for s in window),
                    batch=sum(s.decoding ** 2 * s.steps for s in window) / gaps,
                    kv_tokens=sum(s.decoding * s.steps * s.kv_tokens for s in window) / gaps,
                    seconds=typical + excess, prompt_s=excess)


def forget_unreachable(history: deque[DecodingSteps], now: float, window_s: float = WINDOW_S) -> None:
    """Drop the steps no window at ``now`` or later can reach back to."""
    while history and history[0].ended < now - max(window_s, PACE_HISTORY_S):
        history.popleft()


def pace_changes_after(history: Sequence[DecodingSteps], now: float, window_s: float = WINDOW_S) -> float:
    """The last moment ``step_pace(history, ...)`` is what it is at ``now``, no steps being added: until the
    oldest steps of the window, or of the history it may reach back to, fall out of them."""
    ends = [history[i].ended + reach for reach in (window_s, max(window_s, PACE_HISTORY_S))
            if (i := bisect_left(history, now - reach, key=ENDED)) < len(history)]
    return min(ends, default=float("inf"))
