"""The service base on a real NATS server: rpc error typing, bounded drain, JSON logs."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time

import pytest

from halfmoon.protocol import (
    Ack,
    CancelRequest,
    ErrorCode,
    InstanceDown,
    Leaving,
    Load,
    RemoteError,
    Role,
    codecs,
)
from halfmoon.protocol.base import ErrorReply, Message
from halfmoon.runtime import Service, ServiceConfig, ServiceHost, request
from halfmoon.runtime.logs import JsonFormatter, TextFormatter


class Echo(Service[ServiceConfig]):
    """Acks CancelRequests on ``{ns}.v1.test``; request ids starting with "boom" make the handler crash,
    "slow" ones never get an answer in time, "no" ones a typed refusal."""

    role = Role.DECODE

    def __init__(self, config: ServiceConfig, drain_forever: bool = False) -> None:
        super().__init__(config)
        self.drain_forever = drain_forever
        self.drained = asyncio.Event()

    def load(self) -> Load:
        return Load(queue_len=3)

    async def start(self) -> None:
        await self.serve(f"{self.subjects.root}.test", codecs.CANCEL, self._handle, span_name="echo")

    async def _handle(self, req: CancelRequest) -> Message:
        if req.request_id.startswith("boom"):
            raise KeyError("bug")
        if req.request_id.startswith("slow"):
            await asyncio.sleep(1)
        if req.request_id.startswith("no"):
            raise RemoteError(ErrorReply(code=ErrorCode.BAD_REQUEST, message="refused"))
        return Ack(request_id=req.request_id, instance_id=self.instance_id)

    async def drain(self) -> None:
        if self.drain_forever:
            await asyncio.Event().wait()
        self.drained.set()


@pytest.fixture
def config(nats_server, namespace) -> ServiceConfig:
    return ServiceConfig(
        nats_url=nats_server.url,
        namespace=namespace,
        instance_id="echo-1",
        heartbeat_interval_s=0.05,
        drain_timeout_s=0.3,
    )


async def ask(nc, namespace, rid: str, timeout: float = 5.0):
    return await request(nc, f"{namespace}.v1.test", CancelRequest(request_id=rid), codecs.SUBMIT_REPLY, timeout)


class TestRpcErrors:
    async def test_replies_and_typed_failures(self, config, nc, namespace):
        async with ServiceHost(Echo(config)):
            assert await ask(nc, namespace, "ok-1") == Ack(request_id="ok-1", instance_id="echo-1")
            with pytest.raises(RemoteError) as info:
                await ask(nc, namespace, "boom-1")
            assert info.value.code is ErrorCode.INTERNAL and "KeyError" in info.value.reply.message
            with pytest.raises(RemoteError) as info:
                await ask(nc, namespace, "no-1")
            assert info.value.code is ErrorCode.BAD_REQUEST and info.value.reply.message == "refused"
            reply = codecs.SUBMIT_REPLY.decode((await nc.request(f"{namespace}.v1.test", b"junk", timeout=5)).data)
            assert reply.code is ErrorCode.MALFORMED
            with pytest.raises(RemoteError) as info:
                await ask(nc, namespace, "slow-1", timeout=0.2)
            assert info.value.code is ErrorCode.TIMEOUT and info.value.reply.retryable

    async def test_requests_carry_trace_context(self, config, nc, namespace):
        from halfmoon.telemetry import setup_tracing

        seen: list[dict] = []

        async def capture(msg):
            seen.append(dict(msg.headers or {}))
            await msg.respond(codecs.SUBMIT_REPLY.encode(Ack(request_id="r", instance_id="x")))

        await nc.subscribe(f"{namespace}.v1.test", cb=capture)
        provider = setup_tracing("t", "t-1", env={})
        with provider.get_tracer("t").start_as_current_span("caller") as span:
            await ask(nc, namespace, "r")
        assert seen[0]["traceparent"].split("-")[1] == f"{span.get_span_context().trace_id:032x}"
        provider.shutdown()


class TestNoResponderGrace:
    async def test_without_grace_nobody_listening_fails_at_once(self, nc, namespace):
        with pytest.raises(RemoteError) as info:
            await ask(nc, namespace, "r")
        assert info.value.code is ErrorCode.UNAVAILABLE and "no responders" in info.value.reply.message

    async def test_within_grace_a_responder_that_subscribes_late_gets_the_request_once(self, nc, namespace):
        seen: list[bytes] = []

        async def answer(msg):
            seen.append(msg.data)
            await msg.respond(codecs.SUBMIT_REPLY.encode(Ack(request_id="late", instance_id="x")))

        sent = asyncio.create_task(request(nc, f"{namespace}.v1.test", CancelRequest(request_id="late"),
                                           codecs.SUBMIT_REPLY, 5.0, responder_grace_s=10.0))
        done, _ = await asyncio.wait({sent}, timeout=0.5)
        assert not done  # still re-sending: without the grace it would have failed already
        await nc.subscribe(f"{namespace}.v1.test", cb=answer)  # the peer is back (e.g. reconnected)
        assert await sent == Ack(request_id="late", instance_id="x")
        assert len(seen) == 1  # the sends that reached nobody were not delivered later

    async def test_past_the_grace_nobody_listening_is_unavailable(self, nc, namespace):
        start = time.monotonic()
        with pytest.raises(RemoteError) as info:
            await request(nc, f"{namespace}.v1.test", CancelRequest(request_id="r"), codecs.SUBMIT_REPLY, 5.0,
                          responder_grace_s=0.5)
        assert info.value.code is ErrorCode.UNAVAILABLE and time.monotonic() - start >= 0.4


class TestLifecycle:
    async def test_heartbeats_carry_load_then_drain_and_goodbye(self, config, nc, namespace):
        beats, downs = [], []

        async def on_beat(msg):
            beats.append(codecs.HEARTBEAT.decode(msg.data))

        async def on_down(msg):
            downs.append(codecs.DOWN.decode(msg.data))

        await nc.subscribe(f"{namespace}.v1.registry.heartbeat.decode", cb=on_beat)
        await nc.subscribe(f"{namespace}.v1.registry.down.decode", cb=on_down)
        await nc.flush()
        svc = Echo(config)
        host = ServiceHost(svc)
        await host.start()
        deadline = time.monotonic() + 5
        while len(beats) < 3:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert beats[0].load == Load(queue_len=3) and beats[0].address == "" and beats[0].leaving is None
        await host.stop()
        assert svc.drained.is_set()
        await nc.flush()
        deadline = time.monotonic() + 5
        while not downs:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert beats[-1].leaving is Leaving.DRAINING
        assert downs == [
            InstanceDown(instance_id="echo-1", role=Role.DECODE, reason="shutdown", timestamp=downs[0].timestamp,
                         incarnation=beats[-1].incarnation)  # the goodbye names the run it is about
        ]
        assert beats[-1].incarnation

    async def test_a_drain_that_hangs_is_cut_at_the_timeout(self, config):
        host = ServiceHost(Echo(config, drain_forever=True))
        await host.start()
        started = time.monotonic()
        await host.stop()
        assert 0.3 <= time.monotonic() - started < 3

    async def test_unreachable_nats_fails_after_connect_timeout(self, namespace, unused_port):
        config = ServiceConfig(nats_url=f"nats://127.0.0.1:{unused_port}", namespace=namespace, connect_timeout_s=0.5)
        with pytest.raises(ConnectionError, match="cannot reach NATS"):
            await ServiceHost(Echo(config)).start()


class TestJsonLogs:
    def test_one_object_per_line_with_extras(self):
        record = logging.makeLogRecord(
            {
                "name": "halfmoon.x",
                "levelno": logging.INFO,
                "levelname": "INFO",
                "msg": "placed %s",
                "args": ("r1",),
                "instance": "p0",
            }
        )
        line = JsonFormatter("conductor", "c-1").format(record)
        entry = json.loads(line)
        assert entry["msg"] == "placed r1" and entry["service"] == "conductor"
        assert entry["instance"] == "p0"  # extras win over the static tag of the same name
        assert entry["level"] == "INFO" and entry["ts"].endswith("Z") and "\n" not in line


class TestTextLogLines:
    def record(self, **extra: object) -> logging.LogRecord:
        return logging.makeLogRecord({"name": "halfmoon.conductor", "levelno": logging.INFO, "levelname": "INFO",
                                      "msg": "rejected", **extra})

    def test_the_fields_passed_in_extra_end_the_line(self):
        line = TextFormatter("conductor", "c-1").format(
            self.record(request_id="cmpl-1", reason="overloaded", why="ttft_slo (predicted TTFT 7.63s)"))
        assert line.endswith(' halfmoon.conductor: rejected request_id=cmpl-1 reason=overloaded '
                             'why="ttft_slo (predicted TTFT 7.63s)"')
        assert " INFO conductor/c-1 " in line

    def test_a_line_without_fields_is_the_message_alone_and_a_traceback_follows_the_fields(self):
        assert TextFormatter("gateway", "g-0").format(self.record()).endswith("halfmoon.conductor: rejected")
        try:
            raise ValueError("boom")
        except ValueError:
            record = self.record(request_id="r", exc_info=sys.exc_info())
        first, *rest = TextFormatter("gateway", "g-0").format(record).split("\n")
        assert first.endswith("rejected request_id=r") and rest[0].startswith("Traceback")
