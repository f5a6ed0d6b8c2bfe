"""Whether a service still reaches NATS: the figure behind its health endpoint and its exit when NATS
is gone for good. Pure bookkeeping; the host feeds it the connection's callbacks."""

from __future__ import annotations

import time
from collections.abc import Callable


class NatsLiveness:
    """Contract: ``lost``/``back`` mirror the NATS client's disconnected/reconnected callbacks;
    ``healthy`` is false once NATS has been unreachable for ``lost_deadline_s`` (a probe should
    fail), ``given_up`` once for ``give_up_s`` (the process should exit so its supervisor restarts it).
    Brief outages (a reconnect within the deadline) change neither."""

    def __init__(self, lost_deadline_s: float, give_up_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < lost_deadline_s <= give_up_s:
            raise ValueError(f"need 0 < lost_deadline_s <= give_up_s, got {lost_deadline_s}, {give_up_s}")
        self.lost_deadline_s = lost_deadline_s
        self.give_up_s = give_up_s
        self._clock = clock
        self._lost_since: float | None = None
        self.outages = 0

    def lost(self) -> None:
        if self._lost_since is None:
            self._lost_since = self._clock()
            self.outages += 1

    def back(self) -> None:
        self._lost_since = None

    @property
    def connected(self) -> bool:
        return self._lost_since is None

    def lost_for(self) -> float:
        return 0.0 if self._lost_since is None else self._clock() - self._lost_since

    def healthy(self) -> bool:
        return self.lost_for() < self.lost_deadline_s

    def given_up(self) -> bool:
        return self._lost_since is not None and self.lost_for() >= self.give_up_s

    def status(self) -> tuple[bool, str]:
        """(healthy, a one-line reason) for a health endpoint."""
        if self.healthy():
            return True, "ok" if self.connected else f"ok (NATS unreachable for {self.lost_for():.1f}s, reconnecting)"
        return False, f"NATS unreachable for {self.lost_for():.1f}s (deadline {self.lost_deadline_s}s)"
