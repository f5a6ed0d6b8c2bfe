"""The gateway's questions to its peers that may need asking twice: placement, and re-sending a stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from enum import Enum

import msgspec
import nats.errors

from halfmoon.policy.admission import overload_pause
from halfmoon.protocol import codecs
from halfmoon.protocol.base import Ack, ErrorCode, ProtocolError, RemoteError
from halfmoon.protocol.scheduling import (
    ABSENT_ROLE,
    Readiness,
    ReadinessRequest,
    RejectReason,
    ScheduleAccepted,
    ScheduleRejected,
    ScheduleRequest,
)
from halfmoon.protocol.stream import ResumeRequest
from halfmoon.runtime import Service
from halfmoon.services.gateway.attempts import GenerationError
from halfmoon.telemetry.metrics import METRICS

RESUME_TIMEOUT_S = 1.0
SCHEDULE_BACKOFF_S = 0.2
INSTANCE_POLL_S = 0.5  # how often a request waiting for an instance of an absent role asks again
READY_TIMEOUT_S = 2.0


async def schedule(svc: Service, request: ScheduleRequest, deadline: float, timeout_s: float,
                   on_retry: Callable[[str], None], instance_wait_s: float = 0.0,
                   overload_wait_s: float = 0.0) -> ScheduleAccepted:
    """Ask the conductors; one that died or did not answer in time is asked again (a standby
    takes over) until ``deadline``. A rejection because no instance of a role is live is asked again
    for up to ``instance_wait_s`` (within the deadline): a supervisor brings the instance back in
    seconds. One as ``overloaded`` that the conductor expects to clear (``clears_in_s``: the prompt work
    queued ahead drains, the pace of prompts lately passes) within ``overload_wait_s`` is asked again until
    then, the request's ``waited_s`` telling the conductor how much of its TTFT is spent: an overload that passes within seconds (a wave of
    prompts being computed) delays a request rather than turning it away, and a client that sends the next
    request the moment a 429 comes back does not burn through its requests. Overloads that waiting would not
    clear are answered at once: a request let in late takes what later ones would have had.
    Raises GenerationError on any other rejection or past the deadline."""
    wait_until: float | None = None
    started = time.time()
    while True:
        timeout = min(timeout_s, max(0.1, deadline - time.time()))
        try:
            reply: ScheduleAccepted | ScheduleRejected = await svc.request(
                svc.subjects.schedule, request, codecs.SCHEDULE_REPLY, timeout)
        except (RemoteError, nats.errors.Error) as exc:
            code = exc.code if isinstance(exc, RemoteError) else ErrorCode.UNAVAILABLE
            retryable = code in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE)
            if not retryable or time.time() + SCHEDULE_BACKOFF_S >= deadline:
                raise GenerationError(code, f"conductor: {exc}") from exc
            METRICS.schedule_retries.inc()
            on_retry(str(exc))
            await asyncio.sleep(SCHEDULE_BACKOFF_S)
            continue
        except ProtocolError as exc:
            raise GenerationError(exc.code, f"conductor sent an invalid reply: {exc.message}") from exc
        if isinstance(reply, ScheduleRejected):
            if reply.reason in ABSENT_ROLE:
                wait_until = wait_until or min(deadline, time.time() + instance_wait_s)
                if time.time() + INSTANCE_POLL_S < wait_until:
                    METRICS.schedule_retries.inc()
                    on_retry(f"{reply.reason.value}: waiting for an instance")
                    await asyncio.sleep(INSTANCE_POLL_S)
                    continue
            if reply.reason is RejectReason.OVERLOADED:
                pause = overload_pause(reply.clears_in_s, time.time() - started,
                                       min(deadline - started, overload_wait_s))
                if pause is not None:
                    METRICS.schedule_retries.inc()
                    on_retry(f"overloaded: asking again in {pause:.1f}s")
                    await asyncio.sleep(pause)
                    request = msgspec.structs.replace(request, waited_s=time.time() - started)
                    continue
            METRICS.rejections.labels(reply.reason.value).inc()
            raise GenerationError(ErrorCode.OVERLOADED, f"request rejected ({reply.reason.value}): {reply.message}",
                                  retry_after_s=reply.retry_after_s)
        return reply


async def readiness(svc: Service) -> Readiness | str:
    """A serving conductor's view of whether a request could be placed now, or why nobody said."""
    try:
        return await svc.request(svc.subjects.schedule, ReadinessRequest(), codecs.READINESS_REPLY, READY_TIMEOUT_S)
    except (RemoteError, nats.errors.Error) as exc:
        return f"no conductor answered: {exc}"
    except ProtocolError as exc:
        return f"conductor sent an invalid reply: {exc.message}"


class Resend(Enum):
    HELD = "held"  # an instance holds the attempt (and re-sent what it had)
    NOBODY = "nobody"  # every instance answered that it does not, or is gone
    UNKNOWN = "unknown"  # some did not answer (an outage, a stalled process): wait for the liveness verdict


async def ask_to_resend(svc: Service, resume: ResumeRequest, targets: tuple[str, ...]) -> Resend:
    """Ask ``targets`` to re-send ``resume``'s stream."""
    METRICS.stream_resumes.inc()
    replies = await asyncio.gather(*(svc.request(svc.subjects.resume(t), resume, codecs.SUBMIT_REPLY,
                                                 RESUME_TIMEOUT_S) for t in targets), return_exceptions=True)
    if any(isinstance(r, Ack) for r in replies):
        return Resend.HELD
    if any(not isinstance(r, RemoteError) or r.code is ErrorCode.TIMEOUT for r in replies):
        return Resend.UNKNOWN
    return Resend.NOBODY
