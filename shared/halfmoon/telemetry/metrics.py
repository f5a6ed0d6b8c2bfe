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
# |predicted - delivered| / delivered: 0.1 is a good prediction, 100 one that is off by two orders of magnitude
_ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 100.0, 1000.0)

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
        self.pool_corrupt_blocks = Counter(
            "halfmoon_pool_corrupt_blocks", "pool blocks readers reported failing their MAC, dropped", registry=r
        )
        # reliability (docs/RELIABILITY.md): the request path's recoveries
        self.migrations = Counter(
            "halfmoon_migrations", "requests placed again after an instance failed them", ["reason"], registry=r
        )
        self.migration_exhausted = Counter(
            "halfmoon_migration_limit_reached", "requests failed after using up their migrations", registry=r
        )
        self.instance_losses = Counter(
            "halfmoon_instance_losses", "instances that went down holding this process's requests", ["role"],
            registry=r
        )
        self.paced_placements = Counter(
            "halfmoon_conductor_paced_placements", "requests placed with their prompt paced to a step target "
            "(a long prompt beside decoding sequences, admitted paced instead of turned away)", registry=r
        )
        self.schedule_retries = Counter(
            "halfmoon_schedule_retries", "schedule requests sent again (conductor timeout or absent, no instance of a role, an overload that clears)", registry=r
        )
        self.stream_resumes = Counter(
            "halfmoon_stream_resumes", "resume requests sent for streams with a gap or a stall", registry=r
        )
        self.stream_resends = Counter("halfmoon_stream_resends", "stream events re-sent on request", registry=r)
        self.handoffs_without_pool = Counter(
            "halfmoon_handoffs_without_pool", "hand-offs whose KV had nowhere to go (decode recomputed it)",
            registry=r
        )
        self.pipeline_chunks = Counter(
            "halfmoon_pipeline_chunks", "prompt chunks a prefill instance ran as a pipeline stage (CPP), by stage",
            ["stage"], registry=r
        )
        self.pool_available = Gauge(
            "halfmoon_pool_available", "1 when the last hand-off through the KVCache pool worked", ["instance"],
            registry=r
        )
        self.auth_rejections = Counter(
            "halfmoon_auth_rejections", "API requests refused at the gateway's door", ["reason"], registry=r
        )
        self.ttft_prediction_error = Histogram(
            "halfmoon_ttft_prediction_error_ratio",
            "|conductor's predicted TTFT - delivered TTFT| / delivered TTFT, per request; direction: over "
            "(predicted >= delivered) or under",
            ["direction"],
            buckets=_ERROR_BUCKETS,
            registry=r,
        )
        self.ttft_predicted = Histogram(
            "halfmoon_ttft_predicted_seconds", "the conductor's predicted TTFT of each served request",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_delivered = Histogram(
            "halfmoon_ttft_delivered_seconds", "the delivered TTFT of each request with a prediction, from placement",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.tbt_prediction_error = Histogram(
            "halfmoon_tbt_prediction_error_ratio",
            "|conductor's predicted TBT - delivered mean time between tokens| / delivered, per request served "
            "by its first placement; direction: over (predicted >= delivered) or under",
            ["direction"], buckets=_ERROR_BUCKETS, registry=r)
        self.tbt_predicted = Histogram(
            "halfmoon_tbt_predicted_seconds", "the conductor's predicted TBT of each served request",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.tbt_delivered = Histogram(
            "halfmoon_tbt_delivered_seconds", "the delivered mean time between tokens of each request with a "
            "prediction", buckets=_LATENCY_BUCKETS, registry=r)
        # the conductor's ledger of placed work (docs/OBSERVABILITY.md)
        self.conductor_outstanding = Gauge(
            "halfmoon_conductor_outstanding_requests", "requests placed on an instance and not done, per the "
            "conductor's ledger", ["instance"], registry=r)
        self.conductor_outstanding_work = Gauge(
            "halfmoon_conductor_outstanding_work_seconds", "predicted prefill work placed on an instance and not "
            "done, per the conductor's ledger", ["instance"], registry=r)
        self.ttft_calibration = Gauge(
            "halfmoon_conductor_ttft_calibration", "the conductor's fit of delivered TTFT = intercept + slope x "
            "the cost model's TTFT (parameter: intercept_seconds, slope, samples)", ["parameter"], registry=r)
        self.cost_model = Gauge(
            "halfmoon_conductor_cost_model", "what the conductor's learned cost models predict at a reference point "
            "(figure: seconds for a 1,024-token prefill or for a decode step of 16 sequences holding 16,384 tokens) "
            "and how many measurements they hold", ["model", "figure"], registry=r)
        self.ledger_cleared = Gauge(
            "halfmoon_conductor_ledger_cleared", "ledger entries cleared since the conductor started, by how",
            ["how"], registry=r)
        self.engine_kernels = Gauge(
            "halfmoon_engine_kernels", "1 for the CPU kernels an engine instance runs: kind native (isa: the C "
            "kernels' ISA level) or fallback (PyTorch's operators; reason: why)", ["instance", "kind", "isa", "reason"],
            registry=r)
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self._sources: list[ScrapeSource] = []

    def on_scrape(self, source: ScrapeSource) -> Callable[[], None]:
        """Run ``source(self)`` before every render; returns the function that unregisters it."""
        self._sources.append(source)
        return lambda: self._sources.remove(source) if source in self._sources else None

    def record_ttft_prediction(self, predicted_s: float, delivered_s: float) -> None:
        self.ttft_predicted.observe(predicted_s)
        self.ttft_delivered.observe(delivered_s)
        error = abs(predicted_s - delivered_s) / max(delivered_s, 1e-6)
        self.ttft_prediction_error.labels("over" if predicted_s >= delivered_s else "under").observe(error)

    def record_tbt_prediction(self, predicted_s: float, delivered_s: float) -> None:
        self.tbt_predicted.observe(predicted_s)
        self.tbt_delivered.observe(delivered_s)
        error = abs(predicted_s - delivered_s) / max(delivered_s, 1e-6)
        self.tbt_prediction_error.labels("over" if predicted_s >= delivered_s else "under").observe(error)

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


HealthCheck = Callable[[], tuple[bool, str]]


class MetricsEndpoint:
    """``GET /metrics`` and ``GET /health`` on ``host:port`` (port 0: any free one), served on the
    running event loop. ``/health`` answers 200 or 503 with ``health()``'s reason (the liveness probe)."""

    def __init__(self, metrics: Metrics = METRICS, host: str = "0.0.0.0", port: int = 0,
                 health: HealthCheck = lambda: (True, "ok")) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self.health = health
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
            path = parts[1].split(b"?")[0] if len(parts) >= 2 and parts[0] == b"GET" else b""
            if path == b"/metrics":
                status, ctype, body = "200 OK", self.metrics.content_type, self.metrics.render()
            elif path == b"/health":
                ok, reason = self.health()
                status, ctype, body = ("200 OK" if ok else "503 Service Unavailable"), "text/plain", f"{reason}\n".encode()
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"only GET /metrics and /health are served here\n"
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
