"""When a local deployment restarts a process that exited, and when it gives up: compose's
``restart: unless-stopped`` with exponential backoff, ended by a crash loop. Pure; no processes here."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class CrashLoop(RuntimeError):
    """One process exited too often too fast; the deployment stops and names it."""

    def __init__(self, name: str, exits: int, window_s: float, last_lines: list[str]) -> None:
        tail = "\n".join(f"    {line}" for line in last_lines) or "    (no output)"
        super().__init__(f"{name} is crash-looping: {exits} exits within {window_s:g}s; its last lines:\n{tail}")
        self.name = name


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff doubles from ``backoff_s`` up to ``max_backoff_s`` for each exit in a row; a run that lasted
    ``stable_after_s`` starts the count again. ``crash_loop_exits`` exits within ``crash_loop_window_s``
    of one process is a crash loop."""

    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    stable_after_s: float = 30.0
    crash_loop_exits: int = 5
    crash_loop_window_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.backoff_s <= self.max_backoff_s or self.crash_loop_exits < 1 or self.crash_loop_window_s <= 0:
            raise ValueError(f"bad restart policy {self}")


@dataclass
class ExitRecord:
    """One process's exits, as the policy needs them."""

    started_at: float = 0.0
    in_a_row: int = 0
    exits: deque[float] = field(default_factory=deque)
    restarts: int = 0


class Supervision:
    """Contract: ``started(name, now)`` on every (re)start, ``exited(name, now)`` on every exit; the
    latter returns the delay before the restart, or None for a crash loop (stop everything)."""

    def __init__(self, policy: RestartPolicy = RestartPolicy()) -> None:
        self.policy = policy
        self.records: dict[str, ExitRecord] = {}

    def started(self, name: str, now: float) -> None:
        self.records.setdefault(name, ExitRecord()).started_at = now

    def exited(self, name: str, now: float) -> float | None:
        p, rec = self.policy, self.records.setdefault(name, ExitRecord(started_at=now))
        rec.in_a_row = 1 if now - rec.started_at >= p.stable_after_s else rec.in_a_row + 1
        rec.exits.append(now)
        while rec.exits and rec.exits[0] <= now - p.crash_loop_window_s:
            rec.exits.popleft()
        if len(rec.exits) >= p.crash_loop_exits:
            return None
        rec.restarts += 1
        return min(p.max_backoff_s, p.backoff_s * 2 ** (rec.in_a_row - 1))

    def restarts(self, name: str) -> int:
        rec = self.records.get(name)
        return rec.restarts if rec else 0
