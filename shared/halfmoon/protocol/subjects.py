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
ANY = "*"  # one-token wildcard: only the ``*_any`` patterns (subscriptions, permissions) use it


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
    def prefill_submit(self, instance_id: str, gateway: str) -> str:
        """Request/reply: PrefillRequest -> Ack | ErrorReply, from gateway ``gateway``. The last token names
        the issuing gateway: the worker streams to that gateway's prefix, and each gateway's NATS user may
        publish only its own (``Subjects.submitter``)."""
        return self._prefill_submit(check_token(instance_id, "instance id"), check_token(gateway, "gateway"))

    def decode_submit(self, instance_id: str) -> str:
        """Request/reply: DecodeRequest -> Ack | ErrorReply."""
        return self._decode_submit(check_token(instance_id, "instance id"))

    def decode_kv(self, instance_id: str) -> str:
        """Event: KVProgress, prefill -> the decode instance it will hand the request to (layer-wise hand-off)."""
        return self._decode_kv(check_token(instance_id, "instance id"))

    def _decode_kv(self, instance: str) -> str:
        return f"{self.root}.decode.{instance}.kv"

    @property
    def decode_kv_any(self) -> str:
        return self._decode_kv(ANY)

    def prefill_stage(self, instance_id: str) -> str:
        """Request/reply: StageWork -> StageDone | ErrorReply, to the next stage of a pipelined prefill (CPP)."""
        return self._prefill_stage(check_token(instance_id, "instance id"))

    def _prefill_stage(self, instance: str) -> str:
        return f"{self.root}.prefill.{instance}.stage"

    @property
    def prefill_stage_any(self) -> str:
        return self._prefill_stage(ANY)

    def _prefill_submit(self, instance: str, gateway: str) -> str:
        return f"{self.root}.prefill.{instance}.submit.{gateway}"

    def prefill_submit_to(self, instance_id: str) -> str:
        """Subscription pattern: one prefill (or aggregated) instance's submits, from every gateway."""
        return self._prefill_submit(check_token(instance_id, "instance id"), ANY)

    def prefill_submit_from(self, gateway: str) -> str:
        """Permission pattern: one gateway's submits, to every instance."""
        return self._prefill_submit(ANY, check_token(gateway, "gateway"))

    @staticmethod
    def submitter(subject: str) -> str:
        """The gateway a ``prefill_submit`` subject names as its issuer."""
        return subject.rsplit(".", 1)[-1]

    def _decode_submit(self, instance: str) -> str:
        return f"{self.root}.decode.{instance}.submit"

    @property
    def prefill_submit_any(self) -> str:
        return self._prefill_submit(ANY, ANY)

    @property
    def decode_submit_any(self) -> str:
        return self._decode_submit(ANY)

    def resume(self, instance_id: str) -> str:
        """Request/reply: ResumeRequest -> Ack | ErrorReply, to the prefill or decode instance streaming it."""
        return self._resume(check_token(instance_id, "instance id"))

    def _resume(self, instance: str) -> str:
        return f"{self.root}.resume.{instance}"

    @property
    def resume_any(self) -> str:
        return self._resume(ANY)

    @property
    def placed(self) -> str:
        """Pub/sub: Placed, every conductor's placements, so standby conductors count the load too."""
        return f"{self.root}.conductor.placed"

    @property
    def rejected(self) -> str:
        """Pub/sub: Rejected, every conductor's rejections of schedule requests, for the planner."""
        return f"{self.root}.conductor.rejected"

    @property
    def cancel(self) -> str:
        """Pub/sub: CancelRequest, heard by every prefill and decode instance."""
        return f"{self.root}.request.cancel"

    def work_done_from(self, role: str) -> str:
        """Pub/sub: WorkDone from prefill and decode instances of ``role``, for the conductors' ledgers."""
        return f"{self.root}.work.done.{check_token(role, 'role')}"

    @property
    def work_done(self) -> str:
        """Subscription pattern: WorkDone from every role."""
        return f"{self.root}.work.done.{ANY}"

    def stream(self, gateway: str, request_id: str) -> str:
        """Pub/sub: TokenEvent | ErrorEvent for one request, consumed by the gateway that issued it. Derived
        from both ids, never carried in a message, so a worker streams only into the request it was given;
        prefill takes the gateway from the subject the submit arrived on (``submitter``)."""
        return self._stream(check_token(gateway, "gateway"), check_token(request_id, "request id"))

    def _stream(self, gateway: str, request_id: str) -> str:
        return f"{self.root}.stream.{gateway}.{request_id}"

    @property
    def stream_any(self) -> str:
        return self._stream(ANY, ANY)

    def streams_of(self, gateway: str) -> str:
        """Subscription pattern: every stream of one gateway's requests."""
        return self._stream(check_token(gateway, "gateway"), ANY)

    # registry: the last token names the sender's role, so subject permissions bind a message to a role
    def heartbeat_from(self, role: str) -> str:
        """Pub/sub: Heartbeat from every instance of ``role``."""
        return f"{self.root}.registry.heartbeat.{check_token(role, 'role')}"

    @property
    def heartbeat(self) -> str:
        """Subscription pattern: heartbeats of every role."""
        return f"{self.root}.registry.heartbeat.{ANY}"

    def down_from(self, role: str) -> str:
        """Pub/sub: InstanceDown sent by ``role``: the conductor (silence) or the instance itself (shutdown)."""
        return f"{self.root}.registry.down.{check_token(role, 'role')}"

    @property
    def down(self) -> str:
        """Subscription pattern: InstanceDown from every sender."""
        return f"{self.root}.registry.down.{ANY}"

    @staticmethod
    def sender_role(subject: str) -> str:
        """The role token a registry subject (``heartbeat_from``/``down_from``) names as its sender."""
        return subject.rsplit(".", 1)[-1]

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
        return self._transfer_orders(check_token(instance_id, "instance id"))

    def _transfer_orders(self, instance: str) -> str:
        return f"{self.root}.transfer.{instance}.orders"

    @property
    def transfer_orders_any(self) -> str:
        return self._transfer_orders(ANY)

    @property
    def wildcard(self) -> str:
        """Every subject of this namespace and version (for taps and debugging)."""
        return f"{self.root}.>"


# request/reply: put_start, put_end, lookup, release; pub/sub: report (transfer inventories)
CACHE_OPERATIONS = frozenset({"put_start", "put_end", "lookup", "release", "report", "remove", "corrupt", "stats"})
