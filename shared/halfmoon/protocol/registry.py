"""Liveness and load: heartbeats from every instance, and the news that one is gone."""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Literal

import msgspec

from halfmoon.core.kv_spec import KVSpec
from halfmoon.protocol.base import Message
from halfmoon.protocol.subjects import check_token


class Role(StrEnum):
    GATEWAY = "gateway"
    CONDUCTOR = "conductor"
    PREFILL = "prefill"
    DECODE = "decode"
    AGGREGATED = "aggregated"  # prefills and decodes its requests itself (no hand-off)
    CACHE_MANAGER = "cache-manager"
    TRANSFER = "transfer"


class Leaving(StrEnum):
    """Why an instance is on its way out: it takes no new work, nor is it counted on to serve. The one
    definition every part reads: an instance's heartbeat says it is draining, the conductor's live set
    (placement, waiting for a live instance, readiness) leaves out whatever is leaving, and the
    supervisor of a local deployment stops restarting what is draining and backs off from what is
    crash-looping (silent between tries, so the conductor's silence rule takes it out)."""

    CRASH_LOOPING = "crash-looping"  # exited crash_loop_exits times within crash_loop_window_s
    DRAINING = "draining"  # asked to stop (shutdown, scale-down): finishes or hands back what it holds


class StepSample(msgspec.Struct, frozen=True, kw_only=True):
    """Engine steps that advanced decoding sequences since the previous heartbeat, averaged: a step
    advancing ``batch`` of them while the KV cache held ``kv_tokens`` took ``seconds``. What the
    conductor's decode cost models learn from."""

    steps: int
    batch: float
    kv_tokens: float
    seconds: float

    def __post_init__(self) -> None:
        averages = (self.batch, self.kv_tokens, self.seconds)
        if self.steps < 1 or not all(math.isfinite(a) and a >= 0 for a in averages):
            raise ValueError("a step sample needs steps >= 1 and finite, non-negative averages")


def pooled_steps(*samples: StepSample | None) -> StepSample | None:
    """The average of step samples, each weighted by its number of steps (None when all are None)."""
    present = [s for s in samples if s is not None]
    if not present:
        return None
    steps = sum(s.steps for s in present)
    batch, kv_tokens, seconds = (sum(getattr(s, name) * s.steps for s in present) / steps
                                 for name in ("batch", "kv_tokens", "seconds"))
    return StepSample(steps=steps, batch=batch, kv_tokens=kv_tokens, seconds=seconds)


class Load(msgspec.Struct, frozen=True, kw_only=True):
    """What an instance reports about its load; fields a role does not have stay at 0/None.

    ``ttft_ms`` / ``tbt_ms`` are recent averages (prefill / decode), ``None`` until measured.
    ``accepted_total`` counts every request the instance ever took, so a scheduler can tell
    which of its own placements this report already includes.
    """

    queue_len: int = 0
    running: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    ttft_ms: float | None = None
    tbt_ms: float | None = None
    accepted_total: int = 0
    steps: StepSample | None = None  # decoding steps since the last heartbeat that computed no prompt tokens
    shared_steps: StepSample | None = None  # those that did: an aggregated instance's prefill chunks shared them
    # of the decoding steps of the last window, the share a prompt chunk shared: a decoding sequence's mean
    # time between tokens mixes both kinds in this proportion (None until it decoded)
    shared_step_fraction: float | None = None
    # the decoding steps of the last window (reaching back to enough of them), as the time between tokens a
    # decoding sequence saw (robust to a stalled step; runtime/load_meter.py LoadMeter.window): what TBT
    # predictions start from
    window_steps: StepSample | None = None
    # of window_steps' seconds, what the prompt chunks sharing those steps added per gap (spans and
    # rejections show it: a level far above the instance's usual step is its prompts')
    window_prompt_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.queue_len, self.running, self.free_kv_blocks, self.total_kv_blocks, self.accepted_total) < 0:
            raise ValueError("load counts must be >= 0")
        bound = 0.0 if self.window_steps is None else self.window_steps.seconds
        if not (math.isfinite(self.window_prompt_s) and 0 <= self.window_prompt_s <= bound):
            raise ValueError("window_prompt_s must be finite, >= 0 and within window_steps.seconds (0 without them)")


class KernelReport(msgspec.Struct, frozen=True, kw_only=True):
    """The CPU kernels an engine runs: ``native``, the C kernels built for ISA level ``isa`` (``reason``
    names any of them not loaded), or ``fallback``, PyTorch's operators alone, and ``reason`` why."""

    kind: Literal["native", "fallback"]
    isa: str = ""
    reason: str = ""

    def __str__(self) -> str:
        detail = self.isa if self.kind == "native" else self.reason
        return f"{self.kind} ({detail})" + (f"; {self.reason}" if self.kind == "native" and self.reason else "")


class Heartbeat(Message, frozen=True, kw_only=True, tag="heartbeat"):
    """Periodic "I am alive" with load.

    ``address`` is how peers reach the instance (its submit subject, or ``host:port`` for
    a transfer node or gateway). ``timestamp`` is the sender's unix time; receivers judge
    silence by their own clock. Instances ``leaving`` must not be given new work. ``incarnation``
    names this run of the process: a restart keeps ``instance_id`` and gets a new one.
    """

    instance_id: str
    role: Role
    address: str
    load: Load
    timestamp: float
    interval_s: float
    leaving: Leaving | None = None
    model: str = ""
    kv_spec: KVSpec | None = None  # engine instances: the KV identity their blocks carry
    incarnation: str = ""
    kernels: KernelReport | None = None  # engine instances; absent from other roles and older peers
    paces_prompts: bool = False  # its engine honours a PrefillRequest's step_target_s (Engine.paces_prompts)

    def __post_init__(self) -> None:
        check_token(self.instance_id, "instance_id")
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")


class InstanceDown(Message, frozen=True, kw_only=True, tag="down"):
    """``instance_id`` is gone: ``reason`` is "silent" (conductor noticed), "restarted" (the conductor
    heard a new incarnation beat under the same id) or "shutdown" (it said so).

    ``incarnation`` is the run of the process the notice is about (the one its heartbeats named; empty:
    any): a notice that arrives late, after the instance came back, must not fail work held by the new run.
    Whoever waits on work held by that incarnation fails it now instead of waiting for a timeout.
    """

    instance_id: str
    role: Role
    reason: str
    timestamp: float
    incarnation: str = ""


def heartbeat_sender_ok(sender_role: str, beat: Heartbeat) -> bool:
    """An instance heartbeats for itself only: the subject's sender role must be the beat's role."""
    return sender_role == beat.role.value


def down_sender_ok(sender_role: str, down: InstanceDown) -> bool:
    """Only the conductor declares others down; any other role may only say goodbye for its own role."""
    return sender_role in (down.role.value, Role.CONDUCTOR.value)
