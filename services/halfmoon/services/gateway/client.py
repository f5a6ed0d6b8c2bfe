"""The gateway's side of the serving path: schedule, submit, and follow one request's stream.

A :class:`Generation` yields the request's TokenEvents in output order, each token once. When an
instance holding the request fails (InstanceDown, a retryable ErrorEvent, a stall past the
timeout, a stream nobody holds any more) it migrates the request: a new placement, attempt
number one higher, continuing from the prompt plus the tokens already delivered, up to
``migration_limit`` times. Events of older attempts and indexes already delivered are dropped,
so the client sees one continuous, duplicate-free stream. A gap or a quiet spell (core NATS
drops messages across a reconnect) first asks the instances to re-send (ResumeRequest).
Everything else ends in :class:`GenerationError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import Span

from halfmoon.protocol import codecs
from halfmoon.protocol.base import ErrorCode, ProtocolError, RemoteError
from halfmoon.protocol.registry import InstanceDown
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.scheduling import ScheduleAccepted, ScheduleRequest
from halfmoon.protocol.stream import ErrorEvent, ResumeRequest, TokenEvent
from halfmoon.protocol.work import CancelRequest, PrefillRequest
from halfmoon.runtime import Service
from halfmoon.runtime.rpc import RECONNECT_GRACE_S
from halfmoon.services.gateway.attempts import GenerationError, Lost, Recovery, StreamOrder
from halfmoon.services.gateway.peers import SCHEDULE_BACKOFF_S, Resend, ask_to_resend, schedule
from halfmoon.telemetry.metrics import METRICS

log = logging.getLogger("halfmoon.gateway")


@dataclass(frozen=True)
class Deadlines:
    schedule_timeout_s: float
    submit_timeout_s: float
    ttft_timeout_s: float
    itl_timeout_s: float
    migration_limit: int = 2
    stall_probe_s: float = 2.0  # quiet this long: ask the instances to re-send
    instance_wait_s: float = 0.0  # no live instance of a role: wait this long for one (within the deadline)
    overload_wait_s: float = 0.0  # rejected as overloaded: ask again for this long (within the deadline)


class ServingClient:
    """Starts generations over NATS on behalf of ``service`` and tells them when instances die."""

    def __init__(self, service: Service, model: str, deadlines: Deadlines) -> None:
        self.service = service
        self.model = model
        self.deadlines = deadlines
        self._watchers: dict[str, set[Generation]] = {}

    async def start(self) -> None:
        await self.service.listen_downs(self._on_down)

    @property
    def in_flight(self) -> int:
        return len({g for gens in self._watchers.values() for g in gens})

    def generation(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                   tenant_salt: str | None = None, span: Span | None = None, tenant: str = "") -> Generation:
        return Generation(self, request_id, tuple(prompt_ids), sampling, tenant_salt, span, tenant)

    def watch(self, instance_id: str, gen: Generation) -> None:
        self._watchers.setdefault(instance_id, set()).add(gen)

    def unwatch(self, instance_id: str, gen: Generation) -> None:
        gens = self._watchers.get(instance_id)
        if gens is not None:
            gens.discard(gen)
            if not gens:
                del self._watchers[instance_id]

    async def _on_down(self, down: InstanceDown, _headers: Mapping[str, str]) -> None:
        holders = list(self._watchers.get(down.instance_id, ()))
        if holders:
            METRICS.instance_losses.labels(down.role.value).inc()
        for gen in holders:
            gen.instance_down(down)


class Generation:
    """One request on the serving path; use as ``async with`` and iterate ``events()``."""

    def __init__(self, client: ServingClient, request_id: str, prompt_ids: tuple[int, ...], sampling: SamplingParams,
                 tenant_salt: str | None, span: Span | None = None, tenant: str = "") -> None:
        self.client = client
        self.tenant = tenant  # whose pool quota the request's blocks count against
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.tenant_salt = tenant_salt
        self.span = span
        self.placement: ScheduleAccepted | None = None
        self.finished = False
        self.order = StreamOrder()  # what reached the client: tokens, and the attempt now streaming
        self.recovery = Recovery(client.deadlines.migration_limit)
        self._queue: asyncio.Queue[TokenEvent | ErrorEvent | InstanceDown | Lost] = asyncio.Queue()
        self._sub: Subscription | None = None
        self._watching: set[str] = set()
        self._incarnations: dict[str, str] = {}  # the runs of the current attempt's instances ("": unknown)
        self._handed_off = False  # decode of the current attempt has streamed
        self._placed_at = 0.0  # when the conductor's placement (and its TTFT prediction) arrived
        self._prediction_recorded = False
        self._first_token_at: float | None = None  # the current placement's first token, for its delivered TBT
        self._tokens_since_first = 0

    @property
    def attempt(self) -> int:
        return self.order.attempt

    # ----------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> Generation:
        svc = self.client.service
        # NOTE: subscribe before submitting, or the first tokens could arrive to nobody
        self._sub = await svc.nc.subscribe(svc.subjects.stream(svc.instance_id, self.request_id),
                                           cb=self._on_stream)
        try:
            await self._place_and_submit()
        except BaseException:
            await self._unsubscribe()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for iid in list(self._watching):
            self._unwatch(iid)
        await self._unsubscribe()
        if not self.finished and self.placement is not None:
            await self._cancel(None, "abandoned")

    async def _unsubscribe(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def _cancel(self, attempt: int | None, reason: str) -> None:
        svc = self.client.service
        try:
            await svc.publish(svc.subjects.cancel, CancelRequest(request_id=self.request_id, reason=reason,
                                                                 attempt=attempt))
        except nats.errors.Error as exc:  # an outage: the instance's own deadline frees the work
            log.warning("cancel not sent", extra={"request_id": self.request_id, "error": str(exc)})

    def _event(self, name: str, attributes: Mapping[str, str | int]) -> None:
        if self.span is not None and self.span.is_recording():
            self.span.add_event(name, {"halfmoon.attempt": self.attempt, **attributes})

    # ----------------------------------------------------------------- placement
    async def _place_and_submit(self) -> None:
        """Place attempt ``self.attempt`` (continuing after the tokens delivered so far) and submit it."""
        svc, dl = self.client.service, self.client.deadlines
        deadline = time.time() + dl.ttft_timeout_s
        while True:
            placement = await self._schedule(deadline)
            placed_at = time.monotonic()
            prefill = PrefillRequest(
                request_id=self.request_id, prompt_token_ids=self.prompt_ids, sampling=self.sampling,
                decode_instance=placement.decode_instance,
                deadline=deadline, tenant_salt=self.tenant_salt, output_token_ids=tuple(self.order.tokens),
                attempt=self.attempt, tenant=self.tenant, pipeline=placement.pipeline,
                step_target_s=placement.step_target_s,
            )
            self._watch(placement.prefill_instance)
            self._watch(placement.decode_instance)
            try:
                ack = await svc.request(svc.subjects.prefill_submit(placement.prefill_instance, svc.instance_id), prefill,
                                        codecs.SUBMIT_REPLY, dl.submit_timeout_s,
                                        responder_grace_s=min(RECONNECT_GRACE_S, max(0.0, deadline - time.time())))
            except (RemoteError, ProtocolError, nats.errors.Error) as exc:
                self._unwatch(placement.prefill_instance)
                self._unwatch(placement.decode_instance)
                self.recovery.exclude(placement.prefill_instance)
                code = exc.code if isinstance(exc, RemoteError | ProtocolError) else ErrorCode.UNAVAILABLE
                if code is ErrorCode.UNAVAILABLE and time.time() + SCHEDULE_BACKOFF_S < deadline:
                    # NOTE: surely not taken (draining, gone): the same attempt again, elsewhere if another is
                    # live, costs no migration; the pause lets the conductor notice a dead instance it still lists
                    self._event("submit_refused", {"halfmoon.error": str(exc)})
                    await asyncio.sleep(SCHEDULE_BACKOFF_S)
                    continue
                # NOTE: after a timeout it may be working: only a new attempt may go elsewhere, so
                # that whatever the old one streams is dropped
                await self._cancel(self.attempt, "submit failed")
                if code in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE) and self.recovery.allow(()):
                    self.order.next_attempt()
                    METRICS.migrations.labels(code.value).inc()
                    self._event("migration", {"halfmoon.reason": f"submit failed: {exc}"})
                    continue
                raise GenerationError(code, f"prefill did not take the request: {exc}") from exc
            self.placement, self._handed_off, self._placed_at = placement, False, placed_at
            self._incarnations = {placement.decode_instance: placement.decode_incarnation,
                                  placement.prefill_instance: ack.incarnation or placement.prefill_incarnation}
            self._event("placed", {"halfmoon.prefill": placement.prefill_instance,
                                     "halfmoon.decode": placement.decode_instance,
                                     "halfmoon.resume_index": len(self.order.tokens)})
            return

    async def _schedule(self, deadline: float) -> ScheduleAccepted:
        """Ask the conductors; one that died or did not answer in time is asked again (a standby
        takes over) until the deadline."""
        svc, dl = self.client.service, self.client.deadlines
        context = self.prompt_ids + tuple(self.order.tokens)
        request = ScheduleRequest(
            request_id=self.request_id, model=self.client.model, prompt_len=len(context),
            prompt_token_ids=context, sampling=self.sampling, deadline=deadline, tenant_salt=self.tenant_salt,
            exclude=tuple(sorted(self.recovery.excluded)), attempt=self.attempt,
        )
        return await schedule(svc, request, deadline, dl.schedule_timeout_s,
                              lambda error: self._event("schedule_retry", {"halfmoon.error": error}),
                              dl.instance_wait_s, dl.overload_wait_s)

    def _watch(self, instance_id: str) -> None:
        self._watching.add(instance_id)
        self.client.watch(instance_id, self)

    def _unwatch(self, instance_id: str) -> None:
        self._watching.discard(instance_id)
        self.client.unwatch(instance_id, self)

    # ----------------------------------------------------------------- failures
    async def _on_stream(self, msg: Msg) -> None:
        try:
            event = codecs.STREAM.decode(msg.data)
        except ProtocolError as exc:
            event = ErrorEvent(request_id=self.request_id, code=exc.code, message=f"bad stream event: {exc.message}",
                               attempt=self.attempt)
        self._queue.put_nowait(event)

    def instance_down(self, down: InstanceDown) -> None:
        # NOTE: judged in stream order, against the attempt current then: a notice that arrives while the next
        # attempt is being placed is about the old one's instance unless it names the run the new one got
        self._queue.put_nowait(down)

    def _down(self, down: InstanceDown) -> Lost | None:
        """Migrate unless ``down`` does not concern the current attempt: another run of the instance (a
        late notice about the run before a restart), the prefill instance after decode took over, or
        leaving gracefully after streaming (a draining prefill hands its requests off before it says goodbye)."""
        p = self.placement
        if p is None or down.instance_id not in (p.prefill_instance, p.decode_instance):
            return None
        if down.incarnation and self._incarnations.get(down.instance_id) not in ("", None, down.incarnation):
            self._event("stale_instance_down", {"halfmoon.instance": down.instance_id,
                                                  "halfmoon.incarnation": down.incarnation})
            return None
        is_prefill = down.instance_id == p.prefill_instance and down.instance_id != p.decode_instance
        if is_prefill and (self._handed_off or (down.reason == "shutdown" and self.order.tokens)):
            return None
        self._event("instance_down", {"halfmoon.instance": down.instance_id, "halfmoon.reason": down.reason})
        return Lost(self.attempt, f"{down.role.value} instance {down.instance_id} went down ({down.reason})",
                    ErrorCode.INSTANCE_DOWN, (down.instance_id,))

    async def _migrate(self, lost: Lost) -> None:
        """Place the request again after ``lost``, or raise when it may not migrate any more."""
        p = self.placement
        # avoided, not banned: the conductor still places there if nothing else is left
        failed = lost.instances or ((p.prefill_instance, p.decode_instance) if p else ())
        if not self.recovery.allow(failed):
            METRICS.migration_exhausted.inc()
            self._event("migration_limit", {"halfmoon.reason": lost.message})
            suffix = f"; gave up after {self.recovery.used} migrations" if self.recovery.used else ""
            raise GenerationError(lost.code, lost.message + suffix)
        old = self.attempt
        for iid in list(self._watching):
            self._unwatch(iid)
        await self._cancel(old, "migrated")
        self.order.next_attempt()
        METRICS.migrations.labels(lost.code.value).inc()
        self._event("migration", {"halfmoon.reason": lost.message, "halfmoon.from_attempt": old,
                                    "halfmoon.resume_index": len(self.order.tokens)})
        log.info("migrating request", extra={"request_id": self.request_id, "attempt": self.attempt,
                                             "reason": lost.message, "resume_index": len(self.order.tokens)})
        await self._place_and_submit()

    async def _probe(self) -> Lost | None:
        """Ask the current attempt's instances to re-send from the next index. A Lost when every one of
        them answered that it does not hold the attempt (or is gone); None when one does, or may."""
        p, svc = self.placement, self.client.service
        if p is None:
            return None
        resume = ResumeRequest(request_id=self.request_id, attempt=self.attempt, from_index=len(self.order.tokens))
        targets = tuple(dict.fromkeys((p.decode_instance, p.prefill_instance)))
        self._event("stream_resume", {"halfmoon.from_index": resume.from_index})
        if await ask_to_resend(svc, resume, targets) is not Resend.NOBODY:
            return None
        return Lost(self.attempt, "no instance holds the stream any more", ErrorCode.UNAVAILABLE, targets)

    # ----------------------------------------------------------------- the stream
    async def events(self) -> AsyncIterator[TokenEvent]:
        """TokenEvents in output order until the one with ``finish_reason``; raises GenerationError."""
        dl = self.client.deadlines
        progress = probed = time.monotonic()  # last delivery (or new attempt), last resume request
        while not self.finished:
            phase, limit = ("next token", dl.itl_timeout_s) if self.order.attempt_delivered else (
                "first token", dl.ttft_timeout_s)
            now = time.monotonic()
            idle = now - progress
            outcome: Lost | list[TokenEvent] | None = None
            if idle >= limit:
                outcome = Lost(self.attempt, f"no {phase} within {limit}s", ErrorCode.TIMEOUT, ())
            elif idle >= dl.stall_probe_s and now - probed >= dl.stall_probe_s:
                probed = now  # quiet, or stuck behind a gap: ask for what was lost
                outcome = await self._probe()
            if outcome is None:
                try:
                    item = await asyncio.wait_for(self._queue.get(), min(dl.stall_probe_s, limit - idle))
                except TimeoutError:
                    continue
                outcome = self._judge(item)
            if isinstance(outcome, Lost):
                await self._migrate(outcome)
                progress = probed = time.monotonic()
                continue
            for event in outcome:
                progress = time.monotonic()
                self._record_prediction(progress)
                self._note_holder(event)
                self.finished = event.finish_reason is not None
                self._count_tokens(progress, len(event.token_ids))
                yield event
                if self.finished:
                    return

    def _judge(self, item: TokenEvent | ErrorEvent | InstanceDown | Lost) -> Lost | list[TokenEvent]:
        """What one queue item means: a failure to recover from, or the events now deliverable."""
        if isinstance(item, TokenEvent):
            return self.order.accept(item)[0]
        if isinstance(item, InstanceDown):
            return self._down(item) or []
        if item.attempt != self.attempt:
            return []  # about an attempt already given up
        if isinstance(item, Lost):
            return item
        # NOTE: CANCELLED here is a cancel this generation did not send (it leaves an attempt before cancelling
        # it): the request is still wanted, so it goes elsewhere
        if item.code not in (ErrorCode.UNAVAILABLE, ErrorCode.INSTANCE_DOWN, ErrorCode.INTERNAL, ErrorCode.CANCELLED):
            raise GenerationError(item.code, item.message)
        return Lost(self.attempt, item.message, item.code, ())

    def _record_prediction(self, now: float) -> None:
        """The first token's delivered TTFT against the conductor's prediction for the placement that made it."""
        p = self.placement
        if not self._prediction_recorded and p is not None and p.predicted_ttft_ms is not None:
            delivered_s = now - self._placed_at
            METRICS.record_ttft_prediction(p.predicted_ttft_ms / 1000, delivered_s)
            if self.span is not None and self.span.is_recording():  # one request's error, read from its trace
                self.span.set_attributes({"halfmoon.ttft.predicted_ms": p.predicted_ttft_ms,
                                          "halfmoon.ttft.delivered_ms": round(delivered_s * 1000, 3)})
        self._prediction_recorded = True

    def _count_tokens(self, now: float, tokens: int) -> None:
        """At the end of a request its first placement served whole, the delivered mean time between tokens
        against the conductor's predicted TBT (a migrated request's gaps belong to no one prediction)."""
        if self._first_token_at is None:
            self._first_token_at, tokens = now, tokens - 1
        self._tokens_since_first += tokens
        p = self.placement
        if (self.finished and self.attempt == 0 and p is not None and p.predicted_tbt_ms is not None
                and self._tokens_since_first > 0):
            delivered_s = (now - self._first_token_at) / self._tokens_since_first
            METRICS.record_tbt_prediction(p.predicted_tbt_ms / 1000, delivered_s)
            if self.span is not None and self.span.is_recording():
                self.span.set_attributes({"halfmoon.tbt.predicted_ms": p.predicted_tbt_ms,
                                          "halfmoon.tbt.delivered_ms": round(delivered_s * 1000, 3)})

    def _note_holder(self, event: TokenEvent) -> None:
        """Once decode streams, the prefill instance no longer holds the request."""
        p = self.placement
        if p is not None and not self._handed_off and event.instance_id == p.decode_instance:
            self._handed_off = True
            if p.prefill_instance != p.decode_instance:
                self._unwatch(p.prefill_instance)
