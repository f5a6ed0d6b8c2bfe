"""Runs a Service: NATS connection, heartbeats, graceful drain and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NATS

from halfmoon.protocol.codecs import DOWN, HEARTBEAT
from halfmoon.protocol.permissions import inbox_prefix, nats_user
from halfmoon.protocol.registry import Heartbeat, InstanceDown, Leaving
from halfmoon.runtime.base import Service
from halfmoon.runtime.config import ServiceConfig
from halfmoon.runtime.liveness import NatsLiveness
from halfmoon.runtime.rpc import subscriptions_live
from halfmoon.telemetry.metrics import METRICS, Metrics, MetricsEndpoint

log = logging.getLogger("halfmoon.runtime")


class NatsLost(ConnectionError):
    """NATS stayed unreachable past ``nats_give_up_s``: the process exits non-zero to be restarted."""


async def connect_nats(config: ServiceConfig, name: str, user: str, liveness: NatsLiveness | None = None) -> NATS:
    """Connect as NATS user ``user`` (its credentials, TLS and reply inbox) with unlimited reconnects; give up if the first connect takes ``connect_timeout_s``.

    ``liveness`` learns of every disconnect and reconnect."""
    servers = [s.strip() for s in config.nats_url.split(",") if s.strip()]

    async def on_error(exc: Exception) -> None:
        # while reconnecting every failed attempt lands here; one warning per outage is enough
        level = logging.WARNING if liveness is None or liveness.connected else logging.DEBUG
        log.log(level, "nats error", extra={"error": repr(exc)})

    async def on_disconnect() -> None:
        if liveness is not None:
            liveness.lost()
        log.warning("nats disconnected; reconnecting")

    async def on_reconnect() -> None:
        lost_for = liveness.lost_for() if liveness is not None else 0.0
        if liveness is not None:
            liveness.back()
        log.info("nats reconnected", extra={"lost_s": round(lost_for, 3)})

    # NOTE: with unlimited reconnects nats-py retries the first connect forever too; bound it here
    try:
        return await asyncio.wait_for(
            nats.connect(
                servers=servers,
                name=name,
                connect_timeout=2,
                allow_reconnect=True,
                max_reconnect_attempts=-1,  # never give up by itself: the liveness deadline decides
                reconnect_time_wait=0.5,
                # a server that vanished without closing the socket is noticed within ~10 s, not 4 min
                ping_interval=5,
                max_outstanding_pings=2,
                user=config.nats_user or None,
                password=config.nats_password or None,
                tls=config.nats_tls(),
                inbox_prefix=inbox_prefix(user),
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


def write_ready_file(path: str, info: dict[str, object]) -> None:
    """Atomically, so a reader never sees half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    tmp.write_text(json.dumps(info))
    tmp.replace(target)


class ServiceHost:
    """Owns one service's lifecycle; usable as ``async with ServiceHost(svc):`` in tests."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self._nc: NATS | None = None
        self._beats: asyncio.Task[None] | None = None
        self.metrics: MetricsEndpoint | None = None
        self._unscrape: Callable[[], None] = lambda: None
        self._watchdog: asyncio.Task[None] | None = None
        self.gave_up = False  # NATS was lost for good; the process must exit non-zero

    def _record_load(self, metrics: Metrics) -> None:
        load, role = self.service.load(), self.service.role.value
        metrics.queue_length.labels(role).set(load.queue_len)
        metrics.running_requests.labels(role).set(load.running)

    async def start(self) -> None:
        svc, config = self.service, self.service.config
        self._nc = await connect_nats(config, svc.instance_id, nats_user(svc.role, svc.instance_id), svc.liveness)
        svc.attach(self._nc)
        await svc.start()
        self._unscrape = METRICS.on_scrape(self._record_load)
        if config.metrics_port:
            self.metrics = MetricsEndpoint(METRICS, config.metrics_host, max(config.metrics_port, 0),
                                           health=svc.liveness.status)
            await self.metrics.start()
            log.info(f"metrics on {self.metrics.url}", extra={"metrics_port": self.metrics.port})
        await subscriptions_live(self._nc)  # before start() returns
        if config.ready_file:
            write_ready_file(config.ready_file, {"instance_id": svc.instance_id, "pid": os.getpid(),
                                                 "metrics_port": self.metrics.port if self.metrics else None,
                                                 "address": svc.address,
                                                 "memory": msgspec.to_builtins(svc.memory_report())})
        await self.beat()  # register now, not one interval later
        self._beats = asyncio.create_task(self._beat_forever(), name=f"heartbeat-{svc.instance_id}")
        self._watchdog = asyncio.create_task(self._watch_nats(), name=f"nats-watchdog-{svc.instance_id}")
        log.info("service started", extra={"role": svc.role.value, "address": svc.address})

    async def _watch_nats(self) -> None:
        liveness = self.service.liveness
        while not liveness.given_up():
            await asyncio.sleep(min(1.0, liveness.lost_deadline_s / 4))
        self.gave_up = True
        log.error("NATS unreachable for good; exiting to be restarted",
                  extra={"lost_s": round(liveness.lost_for(), 1), "give_up_s": liveness.give_up_s})
        self.service.stop_requested.set()

    def heartbeat(self) -> Heartbeat:
        svc = self.service
        return Heartbeat(
            instance_id=svc.instance_id,
            role=svc.role,
            address=svc.address,
            load=svc.heartbeat_load(),
            timestamp=time.time(),
            interval_s=svc.config.heartbeat_interval_s,
            leaving=Leaving.DRAINING if svc.draining else None,
            model=svc.model,
            incarnation=svc.incarnation,
            kv_spec=svc.kv_spec,
            kernels=svc.kernels,
            paces_prompts=svc.paces_prompts,
        )

    async def beat(self) -> None:
        assert self._nc is not None
        subject = self.service.subjects.heartbeat_from(self.service.role.value)
        await self._nc.publish(subject, HEARTBEAT.encode(self.heartbeat()))

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.service.config.heartbeat_interval_s)
            try:
                await self.beat()
            except (nats.errors.Error, OSError) as exc:  # reconnecting: the next beat will do
                log.warning("heartbeat not sent", extra={"error": repr(exc)})

    async def stop(self) -> None:
        """Stop taking work, drain (bounded), say goodbye, close; without NATS, close at once."""
        svc = self.service
        svc.draining = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.gave_up:
            await self._close_without_nats()
            return
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
        down = InstanceDown(instance_id=svc.instance_id, role=svc.role, reason="shutdown", timestamp=time.time(),
                            incarnation=svc.incarnation)
        with contextlib.suppress(nats.errors.Error, OSError):
            await self._nc.publish(svc.subjects.down_from(svc.role.value), DOWN.encode(down))
        await svc.close()
        with contextlib.suppress(nats.errors.Error, OSError):
            await self._nc.drain()
        if not self._nc.is_closed:  # drain refuses while reconnecting; stop the reconnect loop too
            await self._nc.close()
        self._unscrape()
        if self.metrics is not None:
            await self.metrics.stop()
        log.info("service stopped")

    async def _close_without_nats(self) -> None:
        """Nobody can be told or drained to: release what the service holds and close."""
        if self._beats is not None:
            self._beats.cancel()
        try:
            await self.service.close()
            assert self._nc is not None
            # NOTE: closing flushes what was published while away into a dead socket: that error must
            # not skip the rest, or the metrics server's thread keeps the process from exiting
            with contextlib.suppress(nats.errors.Error, OSError):
                await self._nc.close()
        finally:
            self._unscrape()
            if self.metrics is not None:
                await self.metrics.stop()
        log.info("service stopped without NATS")

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
    if host.gave_up:
        raise NatsLost(f"NATS at {service.config.nats_url} unreachable for {service.config.nats_give_up_s}s")
