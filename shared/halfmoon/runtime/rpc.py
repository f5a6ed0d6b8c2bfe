"""Typed NATS messaging with trace context: request/reply, publish, and request serving.

Every outgoing message carries the current W3C trace context in its headers; every served
request runs inside a SERVER span that continues the sender's trace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from halfmoon.protocol.base import Codec, ErrorCode, ErrorReply, Message, ProtocolError, RemoteError
from halfmoon.telemetry import extract_context, inject_headers

Req = TypeVar("Req")
Rep = TypeVar("Rep")

RESEND_INTERVAL_S = 0.1
# after a NATS restart a peer's subscriptions return when that peer has reconnected (services retry
# every 0.5 s): "no responders" on a live instance's subject within this grace is that race
RECONNECT_GRACE_S = 3.0

RequestHandler = Callable[[Req], Awaitable[Message]]
AddressedHandler = Callable[[Req, str], Awaitable[Message]]  # also given the subject the request arrived on
EventHandler = Callable[[Req, Mapping[str, str]], Awaitable[None]]


async def subscriptions_live(nc: NATS) -> None:
    """Return once the server holds every subscription made on ``nc`` so far: requests sent to them from
    anywhere from then on find them."""
    # NOTE: nats-py writes flush()'s PING to the socket at once, ahead of the SUBs still queued for its flusher
    # task, so one flush could return before the server had them: a request sent to a service that had just
    # started found no responders (1 in 5-7 starts beside three busy loops). The first round trip lets the
    # flusher write what is queued; the second PING goes after it.
    await nc.flush()
    await nc.flush()


async def publish(nc: NATS, subject: str, message: Message, headers: Mapping[str, str] | None = None) -> None:
    await nc.publish(subject, Codec.encode(message), headers=inject_headers(dict(headers or {})))


async def request(
    nc: NATS,
    subject: str,
    message: Message,
    reply_codec: Codec[Rep | ErrorReply],
    timeout: float,
    headers: Mapping[str, str] | None = None,
    responder_grace_s: float = 0.0,
) -> Rep:
    """Send ``message`` and return the decoded reply.

    Raises :class:`RemoteError` when the peer answered ErrorReply, when nobody listens on
    ``subject`` (UNAVAILABLE) or when no reply came within ``timeout`` (TIMEOUT), and
    :class:`ProtocolError` when the reply is not one of ``reply_codec``'s kinds.
    ``responder_grace_s``: for that long, "nobody listens" is answered by sending again (the
    message was delivered to no one, so this never duplicates it): after a NATS restart the
    peer's subscription comes back when the peer has reconnected, which may be after we have.
    """
    give_up = time.monotonic() + responder_grace_s
    while True:
        try:
            msg = await nc.request(
                subject, Codec.encode(message), timeout=timeout, headers=inject_headers(dict(headers or {}))
            )
            break
        except nats.errors.NoRespondersError:
            if time.monotonic() + RESEND_INTERVAL_S < give_up:
                await asyncio.sleep(RESEND_INTERVAL_S)
                continue
            raise RemoteError(
                ErrorReply(code=ErrorCode.UNAVAILABLE, message=f"no responders on {subject}", retryable=True)
            ) from None
        except nats.errors.TimeoutError:
            raise RemoteError(
                ErrorReply(code=ErrorCode.TIMEOUT, message=f"no reply on {subject} within {timeout}s",
                           retryable=True)
            ) from None
    reply = reply_codec.decode(msg.data)
    if isinstance(reply, ErrorReply):
        raise RemoteError(reply)
    return reply


async def serve_requests(
    nc: NATS,
    subject: str,
    codec: Codec[Req],
    handler: RequestHandler[Req],
    *,
    tracer: trace.Tracer,
    span_name: str,
    log: logging.Logger,
    queue: str = "",
) -> Subscription:
    """Answer requests on ``subject`` with ``handler``'s reply.

    Undecodable requests get the ProtocolError's ErrorReply, handler RemoteErrors their reply,
    any other exception ErrorReply(INTERNAL); the subscription keeps serving either way.
    NOTE: requests of one subscription are handled one after another, so a handler must only
    validate and enqueue, never run the work itself.
    """
    return await serve_addressed_requests(nc, subject, codec, lambda request, _subject: handler(request),
                                          tracer=tracer, span_name=span_name, log=log, queue=queue)


async def serve_addressed_requests(
    nc: NATS,
    subject: str,
    codec: Codec[Req],
    handler: AddressedHandler[Req],
    *,
    tracer: trace.Tracer,
    span_name: str,
    log: logging.Logger,
    queue: str = "",
) -> Subscription:
    """``serve_requests`` for a subject pattern whose tokens say something about the request (who sent it,
    as the sender's permissions vouch): ``handler`` gets the subject each request arrived on too."""

    async def on_message(msg: Msg) -> None:
        with tracer.start_as_current_span(
            span_name, context=extract_context(msg.headers), kind=SpanKind.SERVER
        ) as span:
            reply = await _handle(codec, handler, msg.data, log, msg.subject)
            if isinstance(reply, ErrorReply):
                span.set_status(Status(StatusCode.ERROR, reply.message))
                span.set_attribute("halfmoon.error_code", reply.code.value)
            if msg.reply:
                await nc.publish(msg.reply, Codec.encode(reply))

    return await nc.subscribe(subject, queue=queue, cb=on_message)


async def _handle(
    codec: Codec[Req], handler: AddressedHandler[Req], data: bytes, log: logging.Logger, subject: str
) -> Message:
    try:
        return await handler(codec.decode(data), subject)
    except ProtocolError as exc:
        log.warning("refused message", extra={"subject": subject, "code": exc.code.value, "reason": exc.message})
        return exc.to_reply()
    except RemoteError as exc:
        return exc.reply
    except Exception as exc:  # a handler bug must not kill the subscription
        log.exception("request handler failed", extra={"subject": subject})
        return ErrorReply(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")


async def subscribe_events(
    nc: NATS,
    subject: str,
    codec: Codec[Req],
    handler: EventHandler[Req],
    *,
    log: logging.Logger,
    queue: str = "",
    accept: Callable[[str, Req], bool] | None = None,
) -> Subscription:
    """Deliver decoded pub/sub messages (with their headers) to ``handler``; drop invalid ones with a
    warning, and those ``accept(subject, event)`` refuses (a sender the subject does not vouch for)."""

    async def on_message(msg: Msg) -> None:
        try:
            event = codec.decode(msg.data)
        except ProtocolError as exc:
            log.warning(
                "dropped message", extra={"subject": msg.subject, "code": exc.code.value, "reason": exc.message}
            )
            return
        if accept is not None and not accept(msg.subject, event):
            log.warning("dropped message from a sender not allowed to send it", extra={"subject": msg.subject})
            return
        try:
            await handler(event, msg.headers or {})
        except Exception:
            log.exception("event handler failed", extra={"subject": msg.subject})

    return await nc.subscribe(subject, queue=queue, cb=on_message)
