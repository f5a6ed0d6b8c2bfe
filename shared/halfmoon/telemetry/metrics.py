"""Prometheus metrics of one process: one registry, the named families the dashboard reads, and a
small ``/metrics`` HTTP endpoint served on the process's event loop.

Recording is a labelled counter/histogram update (a lock and an add). Figures that already exist
elsewhere (queue lengths, pool bytes) are not mirrored on every change: sources registered with
:meth:`Metrics.on_scrape` copy them into gauges when ``/metrics`` is read, on the event loop, so
they may read service state without locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger("halfmoon.metrics")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)

ScrapeSource = Callable[["Metrics"], None]


class Metrics:
    """The Halfmoon metric families in one registry (see docs/OBSERVABILITY.md for who records what)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "halfmoon_ttft_seconds",
            "prefill-side time from request to first token",
            ["instance"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tbt = Histogram(
            "halfmoon_tbt_seconds",
            "decode step time (time between tokens)",
            ["instance"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.queue_length = Gauge("halfmoon_queue_length", "requests waiting", ["role"], registry=r)
        self.running_requests = Gauge(
            "halfmoon_running_requests", "requests in the running batch", ["role"], registry=r
        )
        self.cache_hit_blocks = Counter(
            "halfmoon_cache_hit_blocks", "prompt blocks found in the KVCache pool", ["role"], registry=r
        )
        self.cache_miss_blocks = Counter(
            "halfmoon_cache_miss_blocks", "prompt blocks not found in the KVCache pool", ["role"], registry=r
        )
        self.pool_bytes = Gauge(
            "halfmoon_pool_bytes", "bytes of KVCache held per node and tier", ["node", "tier"], registry=r
        )
        self.transfer_bytes = Counter(
            "halfmoon_transfer_bytes", "KV bytes moved by the data plane", ["transport", "direction"], registry=r
        )
        self.rejections = Counter("halfmoon_rejections", "requests refused", ["reason"], registry=r)
        self.errors = Counter("halfmoon_errors", "failures", ["kind"], registry=r)
        self.auth_rejections = Counter(
            "halfmoon_auth_rejections", "API requests refused at the gateway's door", ["reason"], registry=r
        )
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self._sources: list[ScrapeSource] = []

    def on_scrape(self, source: ScrapeSource) -> Callable[[], None]:
        """Run ``source(self)`` before every render; returns the function that unregisters it."""
        self._sources.append(source)
        return lambda: self._sources.remove(source) if source in self._sources else None

    def render(self) -> bytes:
        for source in list(self._sources):
            try:
                source(self)
            except Exception:  # one broken source must not hide every other metric
                log.exception("metrics source failed")
                self.errors.labels("metrics_source").inc()
        return generate_latest(self.registry)


# NOTE: one registry per process; services, the data plane and the endpoint all record here
METRICS = Metrics()


class MetricsEndpoint:
    """``GET /metrics`` on ``host:port`` (port 0: any free one), served on the running event loop."""

    def __init__(self, metrics: Metrics = METRICS, host: str = "0.0.0.0", port: int = 0) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve /metrics on {self.host}:{self.port}: {exc.strerror}") from exc
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 10)
            while (await asyncio.wait_for(reader.readline(), 10)) not in (b"\r\n", b"\n", b""):
                pass  # headers are not needed
            parts = request_line.split()
            if len(parts) >= 2 and parts[0] == b"GET" and parts[1].split(b"?")[0] == b"/metrics":
                status, ctype, body = "200 OK", self.metrics.content_type, self.metrics.render()
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"only GET /metrics is served here\n"
            head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass  # a scraper that went away
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
