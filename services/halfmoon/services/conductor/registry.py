"""The live instance set, fed by heartbeats and judged by the conductor's own clock. No I/O."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from halfmoon.protocol.registry import Heartbeat, Load, Role


class InstanceView(NamedTuple):
    """What a placement policy may know about one live instance."""

    instance_id: str
    role: Role
    address: str
    load: Load
    draining: bool
    assigned: int  # placed here and not in ``load`` yet, minus those finished since ``load`` (may be < 0)


@dataclass(slots=True)
class _Entry:
    heartbeat: Heartbeat
    last_seen: float
    accepted_base: int = 0  # requests the instance had taken before these counts began
    placed_total: int = 0  # requests placed here (by any conductor) since this entry began
    placed_at_beat: int = 0  # placed_total when the last heartbeat arrived
    done_since_beat: int = 0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=4096))  # when recent placements were made

    @property
    def assigned(self) -> int:
        load = self.heartbeat.load
        if load.accepted_total:  # exact: the instance says how many requests its report includes
            unseen = max(0, self.placed_total - (load.accepted_total - self.accepted_base))
        else:  # instances that do not count: whatever was placed since the report
            unseen = self.placed_total - self.placed_at_beat
        return unseen - self.done_since_beat

    def settle(self, now: float, ttl_s: float) -> None:
        """Forget placements older than ``ttl_s`` that never arrived (their requester gave up or died),
        so they do not count as load for ever."""
        while self.recent and now - self.recent[0] > ttl_s:
            self.recent.popleft()
        accepted = self.heartbeat.load.accepted_total - self.accepted_base
        if self.heartbeat.load.accepted_total and self.placed_total - accepted > len(self.recent):
            self.accepted_base -= self.placed_total - accepted - len(self.recent)

    def view(self) -> InstanceView:
        hb = self.heartbeat
        return InstanceView(hb.instance_id, hb.role, hb.address, hb.load, hb.draining, self.assigned)


class InstanceTable:
    """Instances by id. An instance is live until ``max(timeout_s, 3 * its heartbeat interval)``
    passes without a heartbeat; ``expire`` then removes and returns it.

    ``now`` is any monotonic clock in seconds (receipt time, never the sender's timestamp,
    so clock skew between machines cannot expire anyone).

    Placements count as load until the instance's ``accepted_total`` includes them. Counts start
    at the first heartbeat (so a conductor that starts late, a standby, counts right), include
    other conductors' placements (``note_assigned`` for each Placed note), and forget placements
    that never arrived after ``assign_ttl_s``.
    """

    def __init__(self, timeout_s: float, assign_ttl_s: float = 60.0) -> None:
        if timeout_s <= 0 or assign_ttl_s <= 0:
            raise ValueError(f"timeout_s and assign_ttl_s must be > 0, got {timeout_s}, {assign_ttl_s}")
        self.timeout_s = timeout_s
        self.assign_ttl_s = assign_ttl_s
        self._entries: dict[str, _Entry] = {}

    def observe(self, heartbeat: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True when the instance was not known (new or back from silence)."""
        entry = self._entries.get(heartbeat.instance_id)
        if entry is None:
            self._entries[heartbeat.instance_id] = _Entry(heartbeat, now, heartbeat.load.accepted_total)
            return True
        entry.heartbeat, entry.last_seen = heartbeat, now
        entry.placed_at_beat, entry.done_since_beat = entry.placed_total, 0
        entry.settle(now, self.assign_ttl_s)
        return False

    def remove(self, instance_id: str) -> InstanceView | None:
        entry = self._entries.pop(instance_id, None)
        return None if entry is None else entry.view()

    def expire(self, now: float) -> list[InstanceView]:
        """Remove and return every instance silent past its deadline."""
        silent = [
            iid
            for iid, e in self._entries.items()
            if now - e.last_seen > max(self.timeout_s, 3 * e.heartbeat.interval_s)
        ]
        return [self._entries.pop(iid).view() for iid in silent]

    def candidates(self, role: Role) -> list[InstanceView]:
        """Live instances of ``role`` that take new work, in id order."""
        return [
            e.view()
            for iid, e in sorted(self._entries.items())
            if e.heartbeat.role is role and not e.heartbeat.draining
        ]

    def note_assigned(self, instance_id: str, now: float) -> None:
        if (entry := self._entries.get(instance_id)) is not None:
            entry.placed_total += 1
            entry.recent.append(now)

    def hold(self, now: float) -> None:
        """Count every instance as heard from at ``now`` (this side was cut off: silence proves nothing)."""
        for entry in self._entries.values():
            entry.last_seen = max(entry.last_seen, now)

    def note_done(self, instance_id: str) -> None:
        """One request here finished its part since the last heartbeat (which still counted it)."""
        if (entry := self._entries.get(instance_id)) is not None:
            entry.done_since_beat += 1

    def get(self, instance_id: str) -> InstanceView | None:
        entry = self._entries.get(instance_id)
        return None if entry is None else entry.view()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._entries
