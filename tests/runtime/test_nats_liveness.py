"""Liveness on a real NATS server that a test kills and brings back on the same port: the health
endpoints fail past the deadline and recover, heartbeats resume, and a service that loses NATS for
good exits non-zero while a brief outage kills nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest

from halfmoon.protocol import Role, codecs
from halfmoon.protocol.subjects import Subjects
from halfmoon.runtime import Service, ServiceConfig, ServiceHost
from halfmoon.services.gateway.service import GatewayConfig, GatewayService
from tests.conftest import NatsServer


class Idle(Service[ServiceConfig]):
    role = Role.CONDUCTOR

    async def start(self) -> None:
        pass


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A NATS server of this test alone, since the test kills it."""
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


async def until(condition, deadline_s: float = 30.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + deadline_s
    while not await condition():
        assert time.monotonic() < end, f"{what} not reached within {deadline_s}s"
        await asyncio.sleep(0.05)


async def get(url: str) -> httpx.Response:
    """Async: the endpoint is served on this test's own event loop."""
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.get(url)


def status_is(url: str, code: int):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        return (await get(url)).status_code == code
    return check


def settings(server: NatsServer, namespace: str, **extra: object) -> dict[str, object]:
    return dict(nats_url=server.url, namespace=namespace, heartbeat_interval_s=0.1, nats_lost_deadline_s=1.0,
                nats_give_up_s=600.0, **extra)


class TestMetricsPortHealth:
    async def test_fails_while_nats_is_gone_and_recovers_with_heartbeats(self, own_nats, namespace):
        config = ServiceConfig(**settings(own_nats, namespace, instance_id="idle-1", metrics_port=-1))
        async with ServiceHost(Idle(config)) as host:
            health = f"http://127.0.0.1:{host.metrics.port}/health"
            assert (await get(health)).text == "ok\n"
            own_nats.stop()
            await until(status_is(health, 503), what="503 after NATS died")
            assert "NATS unreachable" in (await get(health)).text
            own_nats.start()
            await until(status_is(health, 200), what="200 after NATS came back")
            beats: asyncio.Queue[str] = asyncio.Queue()
            watcher = await nats.connect(own_nats.url)
            try:
                async def on_beat(msg) -> None:  # type: ignore[no-untyped-def]
                    beats.put_nowait(codecs.HEARTBEAT.decode(msg.data).instance_id)

                await watcher.subscribe(Subjects(namespace).heartbeat, cb=on_beat)
                assert await asyncio.wait_for(beats.get(), 10) == "idle-1"
            finally:
                await watcher.close()


class TestGatewayHealth:
    async def test_gateway_health_follows_nats(self, own_nats, namespace, tiny_model_dir):
        config = GatewayConfig(**settings(own_nats, namespace, model_dir=str(tiny_model_dir), port=0))
        async with ServiceHost(GatewayService(config)) as host:
            health = f"{host.service.url}/health"
            assert (await get(health)).json() == {"status": "ok"}
            own_nats.stop()
            await until(status_is(health, 503), what="gateway 503 after NATS died")
            assert (await get(health)).json()["status"] == "nats_unreachable"
            own_nats.start()
            await until(status_is(health, 200), what="gateway 200 after NATS came back")


class TestLostForGood:
    @pytest.mark.parametrize("service", ["conductor", "decode"])
    def test_exits_non_zero_after_the_give_up_deadline(self, own_nats, namespace, processes, tiny_model_dir, service):
        # decode: an engine thread, a metrics server, heartbeats buffered while away (closing flushes them into
        # a dead socket): none of it may keep the process alive, or no restart policy ever brings it back
        proc = processes.start(["-m", f"halfmoon.services.{service}"], {
            "HALFMOON_NATS_URL": own_nats.url, "HALFMOON_NAMESPACE": namespace, "HALFMOON_LOG_FORMAT": "text",
            "HALFMOON_NATS_LOST_DEADLINE_S": "0.5", "HALFMOON_NATS_GIVE_UP_S": "3", "HALFMOON_METRICS_PORT": "-1",
            "HALFMOON_HEARTBEAT_INTERVAL_S": "0.2", "HALFMOON_MODEL_DIR": str(tiny_model_dir)})
        asyncio.run(wait_for_heartbeat(own_nats.url, namespace))
        own_nats.stop()
        assert proc.wait(timeout=90) == 1

    def test_a_brief_outage_kills_nothing(self, own_nats, namespace, processes):
        proc = processes.start(["-m", "halfmoon.services.conductor"], {
            "HALFMOON_NATS_URL": own_nats.url, "HALFMOON_NAMESPACE": namespace, "HALFMOON_INSTANCE_ID": "c-1",
            "HALFMOON_NATS_LOST_DEADLINE_S": "1", "HALFMOON_NATS_GIVE_UP_S": "4"})
        asyncio.run(wait_for_heartbeat(own_nats.url, namespace))
        own_nats.stop()
        own_nats.start()  # back within a moment, well inside the 4 s
        asyncio.run(wait_for_heartbeat(own_nats.url, namespace))
        end = time.monotonic() + 6  # past the give-up deadline counted from the outage
        while time.monotonic() < end:
            assert proc.poll() is None, "a brief outage must not end the process"
            time.sleep(0.1)


async def wait_for_heartbeat(url: str, namespace: str) -> None:
    nc = await nats.connect(url, connect_timeout=5)
    try:
        got = asyncio.Event()

        async def on_beat(_msg) -> None:  # type: ignore[no-untyped-def]
            got.set()

        await nc.subscribe(Subjects(namespace).heartbeat, cb=on_beat)
        await asyncio.wait_for(got.wait(), 60)
    finally:
        await nc.close()
