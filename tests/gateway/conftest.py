"""Gateway fixtures: a conductor, scripted engine peers and a gateway, all on a real NATS server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fake_engine import IdleDecode, Script, ScriptedPrefill

from halfmoon.runtime import ServiceConfig, ServiceHost
from halfmoon.services.conductor.service import ConductorConfig, ConductorService
from halfmoon.services.gateway.service import GatewayConfig, GatewayService


@pytest.fixture
async def conductor(nats_server, namespace) -> AsyncIterator[ConductorService]:
    config = ConductorConfig(
        nats_url=nats_server.url,
        namespace=namespace,
        heartbeat_interval_s=0.1,
        instance_timeout_s=1.5,  # 15 beats: a loaded CI machine delayed some past 0.5 s (a live instance then looked dead)
        sweep_interval_s=0.05,
        retry_after_s=2.0,
    )
    async with ServiceHost(ConductorService(config)) as host:
        yield host.service


class Cluster:
    """Engine peers a test starts; all stopped (gracefully, unless crashed) at teardown."""

    def __init__(self, url: str, namespace: str) -> None:
        self.url, self.namespace = url, namespace
        self.hosts: list[ServiceHost] = []

    def _config(self, instance_id: str) -> ServiceConfig:
        return ServiceConfig(
            nats_url=self.url, namespace=self.namespace, instance_id=instance_id, heartbeat_interval_s=0.05
        )

    async def prefill(self, instance_id: str, script: Script) -> ServiceHost:
        return await self._start(ScriptedPrefill(self._config(instance_id), script))

    async def decode(self, instance_id: str) -> ServiceHost:
        return await self._start(IdleDecode(self._config(instance_id)))

    async def _start(self, service) -> ServiceHost:
        host = ServiceHost(service)
        await host.start()
        self.hosts.append(host)
        return host

    async def crash(self, host: ServiceHost) -> None:
        """Vanish without a goodbye: heartbeats stop, the connection drops."""
        host._beats.cancel()
        await host.service.nc.close()
        self.hosts.remove(host)

    async def stop_all(self) -> None:
        for host in self.hosts:
            await host.stop()


@pytest.fixture
async def cluster(nats_server, namespace) -> AsyncIterator[Cluster]:
    c = Cluster(nats_server.url, namespace)
    yield c
    await c.stop_all()


@pytest.fixture
async def gateway_factory(nats_server, namespace, tiny_model_dir):
    hosts: list[ServiceHost] = []

    async def make(**overrides) -> GatewayService:
        settings = dict(
            nats_url=nats_server.url,
            namespace=namespace,
            model_dir=str(tiny_model_dir),
            model_name="tiny",
            port=0,
            heartbeat_interval_s=0.1,
            ttft_timeout_s=10.0,
            itl_timeout_s=10.0,
            max_model_len=256,
            max_body_bytes=16384,
            max_connections_per_client=256,  # TestFlood opens 208 at once, all from loopback
            drain_timeout_s=5.0,
        )
        settings.update(overrides)
        host = ServiceHost(GatewayService(GatewayConfig(**settings)))
        await host.start()
        hosts.append(host)
        return host.service

    yield make
    for host in hosts:
        await host.stop()


@pytest.fixture
async def gateway(gateway_factory) -> GatewayService:
    return await gateway_factory()


@pytest.fixture
async def http(gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        yield client
