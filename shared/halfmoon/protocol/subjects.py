"""NATS subject names: the only place that spells them.

Every subject lives under ``{namespace}.v{PROTOCOL_VERSION}`` so that two deployments (or two
protocol versions) can share one NATS cluster without seeing each other's traffic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PROTOCOL_VERSION = 1

# NOTE: one subject token: no dots, spaces or wildcards, or routing would silently widen.
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def check_token(value: str, what: str) -> str:
    """Return ``value`` if it is a legal single subject token, else raise ``ValueError``."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} must match [A-Za-z0-9_-]+ to be a subject token, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Subjects:
    """Builds every subject of one deployment namespace."""

    namespace: str = "halfmoon"

    def __post_init__(self) -> None:
        for part in self.namespace.split("."):
            check_token(part, "namespace part")

    @property
    def root(self) -> str:
        return f"{self.namespace}.v{PROTOCOL_VERSION}"

    # conductor
    @property
    def schedule(self) -> str:
        """Request/reply: ScheduleRequest -> ScheduleAccepted | ScheduleRejected | ErrorReply."""
        return f"{self.root}.conductor.schedule"

    # prefill / decode work intake
    def prefill_submit(self, instance_id: str) -> str:
        """Request/reply: PrefillRequest -> Ack | ErrorReply."""
        return f"{self.root}.prefill.{check_token(instance_id, 'instance id')}.submit"

    def decode_submit(self, instance_id: str) -> str:
        """Request/reply: DecodeRequest -> Ack | ErrorReply."""
        return f"{self.root}.decode.{check_token(instance_id, 'instance id')}.submit"

    def resume(self, instance_id: str) -> str:
        """Request/reply: ResumeRequest -> Ack | ErrorReply, to the prefill or decode instance streaming it."""
        return f"{self.root}.resume.{check_token(instance_id, 'instance id')}"

    @property
    def placed(self) -> str:
        """Pub/sub: Placed, every conductor's placements, so standby conductors count the load too."""
        return f"{self.root}.conductor.placed"

    @property
    def cancel(self) -> str:
        """Pub/sub: CancelRequest, heard by every prefill and decode instance."""
        return f"{self.root}.request.cancel"

    def stream(self, request_id: str) -> str:
        """Pub/sub: TokenEvent | ErrorEvent for one request, consumed by its gateway."""
        return f"{self.root}.stream.{check_token(request_id, 'request id')}"

    # registry
    @property
    def heartbeat(self) -> str:
        """Pub/sub: Heartbeat from every instance of every role."""
        return f"{self.root}.registry.heartbeat"

    @property
    def down(self) -> str:
        """Pub/sub: InstanceDown, from the conductor (silence) or the instance itself (shutdown)."""
        return f"{self.root}.registry.down"

    # cache-manager
    def cache(self, operation: str) -> str:
        """Cache-manager subjects; ``operation`` is one of CACHE_OPERATIONS."""
        if operation not in CACHE_OPERATIONS:
            raise ValueError(f"unknown cache operation {operation!r}; known: {sorted(CACHE_OPERATIONS)}")
        return f"{self.root}.cache.{operation}"

    @property
    def kv_events(self) -> str:
        """Pub/sub: prefill instances' local prefix cache changes (KVEvents), for the conductor."""
        return f"{self.root}.kv.events"

    @property
    def kv_snapshot(self) -> str:
        """Pub/sub: a conductor asks prefill instances for KVEvents snapshots (SnapshotRequest)."""
        return f"{self.root}.kv.snapshot"

    def transfer_orders(self, instance_id: str) -> str:
        """Request/reply: the cache-manager's tiering orders (OrderBatch) for one transfer node."""
        return f"{self.root}.transfer.{check_token(instance_id, 'instance id')}.orders"

    @property
    def wildcard(self) -> str:
        """Every subject of this namespace and version (for taps and debugging)."""
        return f"{self.root}.>"


# request/reply: put_start, put_end, lookup, release; pub/sub: report (transfer inventories)
CACHE_OPERATIONS = frozenset({"put_start", "put_end", "lookup", "release", "report", "remove", "stats"})
