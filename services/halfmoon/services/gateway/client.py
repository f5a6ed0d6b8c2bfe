"""The gateway's side of the serving path: schedule, submit, and follow one request's stream.

A :class:`Generation` yields the request's TokenEvents in output order and turns every way
the path can fail into :class:`GenerationError`: conductor rejection, no first token within
``ttft_timeout_s``, no next token within ``itl_timeout_s``, an ErrorEvent, or an InstanceDown
naming an instance that still holds the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from halfmoon.protocol import codecs
from halfmoon.protocol.base import ErrorCode, ProtocolError, RemoteError
from halfmoon.protocol.registry import InstanceDown
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.scheduling import ScheduleAccepted, ScheduleRejected, ScheduleRequest
from halfmoon.protocol.stream import ErrorEvent, TokenEvent
from halfmoon.protocol.work import CancelRequest, PrefillRequest
from halfmoon.service import Service
from halfmoon.telemetry.metrics import METRICS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription


class GenerationError(Exception):
    def __init__(self, code: ErrorCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Deadlines:
    schedule_timeout_s: float
    submit_timeout_s: float
    ttft_timeout_s: float
    itl_timeout_s: float
    submit_attempts: int = 3


class ServingClient:
    """Starts generations over NATS on behalf of ``service`` and fails them when instances die."""

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

    def generation(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, tenant_salt: str | None = None
    ) -> Generation:
        return Generation(self, request_id, tuple(prompt_ids), sampling, tenant_salt)

    def watch(self, instance_id: str, gen: Generation) -> None:
        self._watchers.setdefault(instance_id, set()).add(gen)

    def unwatch(self, instance_id: str, gen: Generation) -> None:
        gens = self._watchers.get(instance_id)
        if gens is not None:
            gens.discard(gen)
            if not gens:
                del self._watchers[instance_id]

    async def _on_down(self, down: InstanceDown, _headers: Mapping[str, str]) -> None:
        for gen in list(self._watchers.get(down.instance_id, ())):
            gen.instance_down(down)


class Generation:
    """One request on the serving path; use as ``async with`` and iterate ``events()``."""

    def __init__(
        self,
        client: ServingClient,
        request_id: str,
        prompt_ids: tuple[int, ...],
        sampling: SamplingParams,
        tenant_salt: str | None,
    ) -> None:
        self.client = client
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.tenant_salt = tenant_salt
        self.placement: ScheduleAccepted | None = None
        self.finished = False
        self._queue: asyncio.Queue[TokenEvent | ErrorEvent] = asyncio.Queue()
        self._sub: Subscription | None = None
        self._watching: set[str] = set()
        self._streamed = False  # some token reached the client

    async def __aenter__(self) -> Generation:
        svc = self.client.service
        subject = svc.subjects.stream(self.request_id)
        # NOTE: subscribe before submitting, or the first tokens could arrive to nobody
        self._sub = await svc.nc.subscribe(subject, cb=self._on_stream)
        try:
            await self._place_and_submit(subject)
        except BaseException:
            await self._unsubscribe()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for iid in list(self._watching):
            self._unwatch(iid)
        await self._unsubscribe()
        if not self.finished and self.placement is not None:
            await self.client.service.publish(
                self.client.service.subjects.cancel, CancelRequest(request_id=self.request_id, reason="abandoned")
            )

    async def _unsubscribe(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def _place_and_submit(self, stream_subject: str) -> None:
        svc, dl = self.client.service, self.client.deadlines
        deadline = time.time() + dl.ttft_timeout_s
        last: RemoteError | None = None
        for _ in range(dl.submit_attempts):
            placement = await self._schedule(deadline)
            prefill = PrefillRequest(
                request_id=self.request_id,
                prompt_token_ids=self.prompt_ids,
                sampling=self.sampling,
                decode_instance=placement.decode_instance,
                stream_subject=stream_subject,
                deadline=deadline,
                tenant_salt=self.tenant_salt,
            )
            self._watch(placement.prefill_instance)
            self._watch(placement.decode_instance)
            try:
                await svc.request(
                    svc.subjects.prefill_submit(placement.prefill_instance),
                    prefill,
                    codecs.SUBMIT_REPLY,
                    dl.submit_timeout_s,
                )
            except (RemoteError, ProtocolError) as exc:
                self._unwatch(placement.prefill_instance)
                self._unwatch(placement.decode_instance)
                # NOTE: only retry when the instance surely did not take it (draining, gone); after a
                # timeout it may be working, and a second placement would stream twice.
                if isinstance(exc, ProtocolError) or exc.code is not ErrorCode.UNAVAILABLE:
                    await svc.publish(
                        svc.subjects.cancel, CancelRequest(request_id=self.request_id, reason="submit failed")
                    )
                    raise GenerationError(exc.code, f"prefill did not take the request: {exc}") from exc
                last = exc
                continue
            self.placement = placement
            return
        assert last is not None
        raise GenerationError(last.code, f"no prefill instance took the request: {last.reply.message}")

    async def _schedule(self, deadline: float) -> ScheduleAccepted:
        svc, dl = self.client.service, self.client.deadlines
        request = ScheduleRequest(
            request_id=self.request_id,
            model=self.client.model,
            prompt_len=len(self.prompt_ids),
            prompt_token_ids=self.prompt_ids,
            sampling=self.sampling,
            deadline=deadline,
            tenant_salt=self.tenant_salt,
        )
        try:
            reply = await svc.request(svc.subjects.schedule, request, codecs.SCHEDULE_REPLY, dl.schedule_timeout_s)
        except RemoteError as exc:
            raise GenerationError(exc.code, f"conductor: {exc.reply.message}") from exc
        except ProtocolError as exc:
            raise GenerationError(exc.code, f"conductor sent an invalid reply: {exc.message}") from exc
        if isinstance(reply, ScheduleRejected):
            METRICS.rejections.labels(reply.reason.value).inc()
            raise GenerationError(
                ErrorCode.OVERLOADED,
                f"request rejected ({reply.reason.value}): {reply.message}",
                retry_after_s=reply.retry_after_s,
            )
        return reply

    def _watch(self, instance_id: str) -> None:
        self._watching.add(instance_id)
        self.client.watch(instance_id, self)

    def _unwatch(self, instance_id: str) -> None:
        self._watching.discard(instance_id)
        self.client.unwatch(instance_id, self)

    async def _on_stream(self, msg: Msg) -> None:
        try:
            event = codecs.STREAM.decode(msg.data)
        except ProtocolError as exc:
            event = ErrorEvent(request_id=self.request_id, code=exc.code, message=f"bad stream event: {exc.message}")
        self._queue.put_nowait(event)

    def _handed_off(self, event: TokenEvent) -> bool:
        """Decode has the request: it streams from index 1 on (prefill sent index 0)."""
        p = self.placement
        if p is None or p.prefill_instance not in self._watching:
            return False
        return event.instance_id == p.decode_instance or (not event.instance_id and event.index >= 1)

    def _from_placement(self, instance_id: str) -> bool:
        p = self.placement
        return not instance_id or p is None or instance_id in (p.prefill_instance, p.decode_instance)

    def instance_down(self, down: InstanceDown) -> None:
        """Fail unless ``down`` is the prefill instance leaving gracefully after streaming the first
        token: a draining prefill hands its requests off before it says goodbye."""
        p = self.placement
        graceful_after_handoff = (
            p is not None and down.instance_id == p.prefill_instance and down.reason == "shutdown" and self._streamed
        )
        if not graceful_after_handoff:
            self.fail(
                ErrorCode.INSTANCE_DOWN, f"{down.role.value} instance {down.instance_id} went down ({down.reason})"
            )

    def fail(self, code: ErrorCode, message: str) -> None:
        self._queue.put_nowait(ErrorEvent(request_id=self.request_id, code=code, message=message))

    async def events(self) -> AsyncIterator[TokenEvent]:
        """TokenEvents in output order until the one with ``finish_reason``; raises GenerationError."""
        dl = self.client.deadlines
        expected, early = 0, {}
        timeout, phase = dl.ttft_timeout_s, "first token"
        while not self.finished:
            try:
                event = await asyncio.wait_for(self._queue.get(), timeout)
            except TimeoutError:
                raise GenerationError(ErrorCode.TIMEOUT, f"no {phase} within {timeout}s") from None
            if isinstance(event, ErrorEvent):
                raise GenerationError(event.code, event.message)
            if event.index < expected or not self._from_placement(event.instance_id):
                continue  # a duplicate, or a stray from an instance that does not hold this request
            early[event.index] = event
            while expected in early:
                ready = early.pop(expected)
                expected += len(ready.token_ids)
                self._streamed = True
                if self._handed_off(ready):
                    self._unwatch(self.placement.prefill_instance)
                self.finished = ready.finish_reason is not None
                timeout, phase = dl.itl_timeout_s, "next token"
                yield ready
                if self.finished:
                    return
