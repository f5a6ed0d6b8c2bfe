"""Runs a Service: NATS connection, heartbeats, graceful drain and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable

import nats
import nats.errors
from halfmoon.protocol.codecs import DOWN, HEARTBEAT
from halfmoon.protocol.permissions import inbox_prefix
from halfmoon.protocol.registry import Heartbeat, InstanceDown
from halfmoon.service.base import Service
from halfmoon.service.config import ServiceConfig
from halfmoon.telemetry.metrics import METRICS, Metrics, MetricsEndpoint
from nats.aio.client import Client as NATS

log = logging.getLogger("halfmoon.service")


async def connect_nats(config: ServiceConfig, name: str, role: str) -> NATS:
    """Connect as ``role`` (its credentials, TLS and reply inbox) with unlimited reconnects; give up if
    the first connect takes ``connect_timeout_s``."""
    servers = [s.strip() for s in config.nats_url.split(",") if s.strip()]

    async def on_error(exc: Exception) -> None:
        log.warning("nats error", extra={"error": repr(exc)})

    async def on_disconnect() -> None:
        log.info("nats disconnected")

    async def on_reconnect() -> None:
        log.info("nats reconnected")

    # NOTE: with unlimited reconnects nats-py retries the first connect forever too; bound it here
    try:
        return await asyncio.wait_for(
            nats.connect(
                servers=servers,
                name=name,
                connect_timeout=2,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                user=config.nats_user or None,
                password=config.nats_password or None,
                tls=config.nats_tls(),
                inbox_prefix=inbox_prefix(role),
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
            ),
            config.connect_timeout_s,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        raise ConnectionError(
            f"cannot reach NATS at {config.nats_url} within {config.connect_timeout_s}s: {exc!r}"
        ) from exc


class ServiceHost:
    """Owns one service's lifecycle; usable as ``async with ServiceHost(svc):`` in tests."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self._nc: NATS | None = None
        self._beats: asyncio.Task[None] | None = None
        self.metrics: MetricsEndpoint | None = None
        self._unscrape: Callable[[], None] = lambda: None

    def _record_load(self, metrics: Metrics) -> None:
        load, role = self.service.load(), self.service.role.value
        metrics.queue_length.labels(role).set(load.queue_len)
        metrics.running_requests.labels(role).set(load.running)

    async def start(self) -> None:
        self._nc = await connect_nats(self.service.config, self.service.instance_id, self.service.role.value)
        self.service.attach(self._nc)
        await self.service.start()
        self._unscrape = METRICS.on_scrape(self._record_load)
        port = self.service.config.metrics_port
        if port:
            self.metrics = MetricsEndpoint(METRICS, self.service.config.metrics_host, max(port, 0))
            await self.metrics.start()
            log.info(f"metrics on {self.metrics.url}", extra={"metrics_port": self.metrics.port})
        await self._nc.flush()  # subscriptions are live on the server before start() returns
        await self.beat()  # register now, not one interval later
        self._beats = asyncio.create_task(self._beat_forever(), name=f"heartbeat-{self.service.instance_id}")
        log.info("service started", extra={"role": self.service.role.value, "address": self.service.address})

    def heartbeat(self) -> Heartbeat:
        svc = self.service
        return Heartbeat(
            instance_id=svc.instance_id,
            role=svc.role,
            address=svc.address,
            load=svc.load(),
            timestamp=time.time(),
            interval_s=svc.config.heartbeat_interval_s,
            draining=svc.draining,
            model=svc.model,
            kv_spec=svc.kv_spec,
        )

    async def beat(self) -> None:
        assert self._nc is not None
        await self._nc.publish(self.service.subjects.heartbeat_from(self.service.role.value), HEARTBEAT.encode(self.heartbeat()))

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.service.config.heartbeat_interval_s)
            try:
                await self.beat()
            except (nats.errors.Error, OSError) as exc:  # reconnecting: the next beat will do
                log.warning("heartbeat not sent", extra={"error": repr(exc)})

    async def stop(self) -> None:
        """Stop taking work, drain (bounded), say goodbye, close."""
        svc = self.service
        svc.draining = True
        with contextlib.suppress(nats.errors.Error, OSError):
            await self.beat()
        try:
            await asyncio.wait_for(svc.drain(), svc.config.drain_timeout_s)
        except TimeoutError:
            log.warning("drain timed out; closing with work left", extra={"timeout_s": svc.config.drain_timeout_s})
        if self._beats is not None:
            self._beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beats
        assert self._nc is not None
        down = InstanceDown(instance_id=svc.instance_id, role=svc.role, reason="shutdown", timestamp=time.time())
        with contextlib.suppress(nats.errors.Error, OSError):
            await self._nc.publish(svc.subjects.down_from(svc.role.value), DOWN.encode(down))
        await svc.close()
        with contextlib.suppress(nats.errors.Error, OSError):
            await self._nc.drain()
        self._unscrape()
        if self.metrics is not None:
            await self.metrics.stop()
        log.info("service stopped")

    async def __aenter__(self) -> ServiceHost:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def serve_until_signalled(service: Service) -> None:
    """Run ``service`` until SIGTERM/SIGINT (or ``stop_requested``), then shut it down gracefully."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stop_requested.set)
    host = ServiceHost(service)
    await host.start()
    await service.stop_requested.wait()
    log.info("stop requested; draining")
    await host.stop()
