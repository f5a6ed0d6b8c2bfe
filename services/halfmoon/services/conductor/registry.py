"""The live instance set, fed by heartbeats and judged by the conductor's own clock. No I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from halfmoon.policy.ledger import Outstanding
from halfmoon.protocol.registry import Heartbeat, Leaving, Load, Role


class InstanceView(NamedTuple):
    """What a placement policy may know about one live instance."""

    instance_id: str
    role: Role
    address: str
    load: Load
    leaving: Leaving | None
    outstanding: Outstanding = Outstanding()  # the conductor's ledger of work placed here and not done
    incarnation: str = ""  # the run of the process its last heartbeat named
    left: int = 0  # requests it reported done since its last heartbeat
    paces_prompts: bool = False  # its engine honours a prompt's step target (Heartbeat.paces_prompts)

    @property
    def running(self) -> int:
        """Sequences in its batch: its last heartbeat's, less those it reported done since. A heartbeat lags
        by up to an interval: when a wave of 8 streams ended together, the requests that took their places
        were judged beside a batch of 8 that had left, and turned away."""
        return max(0, self.load.running - self.left)

    @property
    def pending(self) -> int:
        """Requests here: those it reports, or those placed here and not done, whichever is more
        (placed work may not have arrived yet; reported work may predate this conductor)."""
        return max(self.load.queue_len + self.running, self.outstanding.requests)


@dataclass(slots=True)
class _Entry:
    heartbeat: Heartbeat
    last_seen: float
    left: int = 0

    def view(self) -> InstanceView:
        hb = self.heartbeat
        return InstanceView(hb.instance_id, hb.role, hb.address, hb.load, hb.leaving, incarnation=hb.incarnation,
                            left=self.left, paces_prompts=hb.paces_prompts)


class InstanceTable:
    """Instances by id. An instance is live until ``max(timeout_s, 3 * its heartbeat interval)``
    passes without a heartbeat; ``expire`` then removes and returns it.

    ``now`` is any monotonic clock in seconds (receipt time, never the sender's timestamp,
    so clock skew between machines cannot expire anyone). Work placed on instances is kept
    apart, in the conductor's :class:`~halfmoon.policy.ledger.WorkLedger`.
    """

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._entries: dict[str, _Entry] = {}

    def observe(self, heartbeat: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True when the instance was not known (new or back from silence)."""
        entry = self._entries.get(heartbeat.instance_id)
        if entry is None:
            self._entries[heartbeat.instance_id] = _Entry(heartbeat, now)
            return True
        entry.heartbeat, entry.last_seen, entry.left = heartbeat, now, 0
        return False

    def request_left(self, instance_id: str) -> None:
        """``instance_id`` reported a request done: it is no longer in the batch its last heartbeat counted."""
        entry = self._entries.get(instance_id)
        if entry is not None:
            entry.left += 1

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
        """Live instances of ``role`` that take new work (none ``leaving``), in id order."""
        return [
            e.view()
            for iid, e in sorted(self._entries.items())
            if e.heartbeat.role is role and e.heartbeat.leaving is None
        ]

    def hold(self, now: float) -> None:
        """Count every instance as heard from at ``now`` (this side was cut off: silence proves nothing)."""
        for entry in self._entries.values():
            entry.last_seen = max(entry.last_seen, now)

    def ids(self) -> list[str]:
        return sorted(self._entries)

    def get(self, instance_id: str) -> InstanceView | None:
        entry = self._entries.get(instance_id)
        return None if entry is None else entry.view()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._entries
