"""When a local deployment restarts a process that exited: compose's ``restart: unless-stopped`` with
exponential backoff, and Kubernetes' CrashLoopBackOff for a process that keeps exiting (it waits long
between tries, the others go on serving). Pure; no processes here."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from halfmoon.protocol.registry import Leaving


class CrashLoop(RuntimeError):
    """One process exited too often too fast while the deployment was starting: it never came up, so the
    start fails and names it."""

    def __init__(self, name: str, exits: int, window_s: float, last_lines: list[str]) -> None:
        tail = "\n".join(f"    {line}" for line in last_lines) or "    (no output)"
        super().__init__(f"{name} is crash-looping: {exits} exits within {window_s:g}s; its last lines:\n{tail}")
        self.name = name


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff doubles from ``backoff_s`` up to ``max_backoff_s`` for each exit in a row; a run that lasted
    ``stable_after_s`` starts the count again. ``crash_loop_exits`` exits within ``crash_loop_window_s``
    of one process is a crash loop: it is restarted after ``crash_loop_backoff_s`` (Kubernetes' cap, 5 min)."""

    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    stable_after_s: float = 30.0
    crash_loop_exits: int = 5
    crash_loop_window_s: float = 60.0
    crash_loop_backoff_s: float = 300.0

    def __post_init__(self) -> None:
        if (not 0 < self.backoff_s <= self.max_backoff_s <= self.crash_loop_backoff_s or self.crash_loop_exits < 1
                or self.crash_loop_window_s <= 0):
            raise ValueError(f"bad restart policy {self}")


@dataclass
class ExitRecord:
    """One process's exits, as the policy needs them."""

    started_at: float = 0.0
    in_a_row: int = 0
    exits: deque[float] = field(default_factory=deque)
    restarts: int = 0
    stopping: bool = False


class Supervision:
    """Contract: ``started(name, now)`` on every (re)start, ``exited(name, now)`` on every exit of a process
    not ``leaving`` as draining (``stopping(name)`` was called); it returns the delay before the restart,
    and ``due(now)`` names the process once that delay has passed."""

    def __init__(self, policy: RestartPolicy = RestartPolicy()) -> None:
        self.policy = policy
        self.records: dict[str, ExitRecord] = {}
        self.restart_at: dict[str, float] = {}  # exited, to be restarted at this time

    def started(self, name: str, now: float) -> None:
        self.records.setdefault(name, ExitRecord()).started_at = now

    def exited(self, name: str, now: float) -> float:
        p, rec = self.policy, self.records.setdefault(name, ExitRecord(started_at=now))
        rec.in_a_row = 1 if now - rec.started_at >= p.stable_after_s else rec.in_a_row + 1
        rec.exits.append(now)
        rec.restarts += 1
        if self.leaving(name, now) is Leaving.CRASH_LOOPING:
            delay = p.crash_loop_backoff_s
        else:
            delay = min(p.max_backoff_s, p.backoff_s * 2 ** (rec.in_a_row - 1))
        self.restart_at[name] = now + delay
        return delay

    def awaiting_restart(self, name: str) -> bool:
        return name in self.restart_at

    def due(self, now: float) -> list[str]:
        """The processes whose backoff is over, each named once: the caller starts them now."""
        names = [name for name, at in self.restart_at.items() if at <= now]
        for name in names:
            del self.restart_at[name]
        return names

    def stopping(self, name: str) -> None:
        """``name`` was asked to stop: from now on it is leaving, and its exit is not restarted (nor one it
        was waiting for)."""
        self.records.setdefault(name, ExitRecord()).stopping = True
        self.restart_at.pop(name, None)

    def leaving(self, name: str, now: float) -> Leaving | None:
        """Why ``name`` is on its way out (draining wins: a crash-looping process asked to stop is stopping)."""
        rec = self.records.get(name)
        if rec is None:
            return None
        if rec.stopping:
            return Leaving.DRAINING
        while rec.exits and rec.exits[0] <= now - self.policy.crash_loop_window_s:
            rec.exits.popleft()
        return Leaving.CRASH_LOOPING if len(rec.exits) >= self.policy.crash_loop_exits else None

    def restarts(self, name: str) -> int:
        rec = self.records.get(name)
        return rec.restarts if rec else 0
