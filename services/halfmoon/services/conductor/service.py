"""The conductor: live instance set from heartbeats, and ScheduleRequest -> a prefill/decode pair."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from halfmoon.core.kv_spec import KVSpecMismatch
from halfmoon.protocol import codecs
from halfmoon.protocol.base import Message
from halfmoon.protocol.pool import KVEvents, SnapshotRequest
from halfmoon.protocol.registry import Heartbeat, InstanceDown, Load, Role
from halfmoon.protocol.scheduling import RejectReason, ScheduleAccepted, ScheduleRejected, ScheduleRequest
from halfmoon.service import Service, ServiceConfig
from halfmoon.services.conductor.placement import Placement, PlacementPolicy
from halfmoon.services.conductor.policy_config import PolicySettings, build_placement
from halfmoon.services.conductor.registry import InstanceTable
from opentelemetry.trace import TracerProvider


@dataclass(frozen=True)
class ConductorConfig(ServiceConfig, PolicySettings):
    instance_timeout_s: float = field(default=3.0, metadata={"help": "drop an instance silent this long"})
    sweep_interval_s: float = field(default=0.25, metadata={"help": "how often to look for silent instances"})
    retry_after_s: float = field(default=1.0, metadata={"help": "Retry-After suggested on rejection"})

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("instance_timeout_s", "sweep_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        self.check_policy()


class ConductorService(Service[ConductorConfig]):
    """Schedules on the ``schedule`` subject (queue group, so standbys never answer twice)."""

    role = Role.CONDUCTOR
    config_class = ConductorConfig

    def __init__(
        self,
        config: ConductorConfig,
        tracer_provider: TracerProvider | None = None,
        policy: PlacementPolicy | None = None,
    ) -> None:
        super().__init__(config, tracer_provider)
        self.table = InstanceTable(config.instance_timeout_s)
        built, self.block_index, self.prefill_cost = build_placement(config)
        self.policy = policy or built
        self._sweeper: asyncio.Task[None] | None = None
        self._refused: set[str] = set()  # instances whose KV spec disagrees (logged once each)

    def load(self) -> Load:
        return Load(running=len(self.table))

    async def start(self) -> None:
        await self.listen_heartbeats(self._on_heartbeat)
        await self.listen_downs(self._on_down)
        await self.listen(self.subjects.kv_events, codecs.KV_EVENTS, self._on_kv_events)
        await self.serve(
            self.subjects.schedule,
            codecs.SCHEDULE_REQUEST,
            self._on_schedule,
            span_name="conductor.schedule",
            queue="conductor",
        )
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="conductor-sweeper")
        # Rebuild what prefill instances hold in their local caches (after a restart, too).
        await self.publish(self.subjects.kv_snapshot, SnapshotRequest())

    async def _on_kv_events(self, events: KVEvents, _headers: Mapping[str, str]) -> None:
        self.block_index.apply(events.instance_id, events.stored, events.evicted, events.snapshot)
        if not events.snapshot:  # one prefill finished: its queue is shorter before the heartbeat says so
            self.table.note_done(events.instance_id)
        if self.prefill_cost is not None:
            for new, cached, seconds in events.prefill_samples:
                self.prefill_cost.record(new, cached, seconds)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def _on_heartbeat(self, heartbeat: Heartbeat, _headers: Mapping[str, str]) -> None:
        if heartbeat.kv_spec is not None:
            try:
                self.policy.adopt(heartbeat.kv_spec, heartbeat.instance_id)
            except KVSpecMismatch as exc:
                if heartbeat.instance_id not in self._refused:
                    self._refused.add(heartbeat.instance_id)
                    self.log.error("instance refused: its KV blocks would not match the others'",
                                   extra={"instance": heartbeat.instance_id, "why": str(exc)})
                return
        if self.table.observe(heartbeat, time.monotonic()):
            self.log.info("instance up", extra={"instance": heartbeat.instance_id, "role": heartbeat.role.value})

    async def _on_down(self, down: InstanceDown, _headers: Mapping[str, str]) -> None:
        self.block_index.forget(down.instance_id)
        if down.reason != "silent" and self.table.remove(down.instance_id) is not None:
            self.log.info("instance left", extra={"instance": down.instance_id, "reason": down.reason})

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            for gone in self.table.expire(time.monotonic()):
                self.block_index.forget(gone.instance_id)
                self.log.warning("instance silent; dropped", extra={"instance": gone.instance_id})
                down = InstanceDown(
                    instance_id=gone.instance_id, role=gone.role, reason="silent", timestamp=time.time()
                )
                await self.publish(self.subjects.down_from(self.role.value), down)

    async def _on_schedule(self, request: ScheduleRequest) -> Message:
        if self.draining:
            return self._reject(request, RejectReason.OVERLOADED, "conductor is shutting down")
        if request.deadline <= time.time():
            return self._reject(request, RejectReason.DEADLINE, "deadline passed before scheduling")
        choice = self.policy.place(request, self.table.candidates(Role.PREFILL), self.table.candidates(Role.DECODE),
                                   now=time.time())
        if not isinstance(choice, Placement):
            return self._reject(request, choice.reason, choice.message, choice.retry_after_s)
        self.table.note_assigned(choice.prefill)
        self.table.note_assigned(choice.decode)
        return ScheduleAccepted(
            request_id=request.request_id,
            prefill_instance=choice.prefill,
            decode_instance=choice.decode,
            predicted_ttft_ms=choice.predicted_ttft_ms,
        )

    def _reject(self, request: ScheduleRequest, reason: RejectReason, message: str,
                retry_after_s: float | None = None) -> ScheduleRejected:
        self.log.info("rejected", extra={"request_id": request.request_id, "reason": reason.value, "why": message})
        retry = self.config.retry_after_s if retry_after_s is None else retry_after_s
        return ScheduleRejected(request_id=request.request_id, reason=reason, message=message, retry_after_s=retry)
