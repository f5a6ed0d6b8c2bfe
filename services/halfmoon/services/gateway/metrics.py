"""Prometheus metrics of one gateway, in its own registry (several gateways may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from halfmoon.telemetry.metrics import METRICS

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "halfmoon_gateway_requests", "HTTP requests answered", ["endpoint", "status"], registry=self.registry
        )
        self.in_flight = Gauge("halfmoon_gateway_in_flight", "generations in progress", registry=self.registry)
        self.ttft = Histogram(
            "halfmoon_gateway_ttft_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=self.registry
        )
        self.itl = Histogram(
            "halfmoon_gateway_inter_token_seconds",
            "time between token events",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter("halfmoon_gateway_prompt_tokens", "prompt tokens served", registry=self.registry)
        self.cached_tokens = Counter(
            "halfmoon_gateway_cached_prompt_tokens", "prompt tokens reused from cache", registry=self.registry
        )
        self.completion_tokens = Counter(
            "halfmoon_gateway_completion_tokens", "tokens generated", registry=self.registry
        )

    def render(self) -> bytes:
        """This gateway's metrics, then the process-wide ones (rejections, errors, load)."""
        return generate_latest(self.registry) + METRICS.render()
