"""Tracer setup per service, with exporters chosen by the standard OTEL_* variables.

- ``OTEL_SDK_DISABLED=true``: no exporter at all.
- ``OTEL_TRACES_EXPORTER``: comma list of ``otlp``, ``console``, ``none``; when unset it is
  ``otlp`` if ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is
  set, else nothing. OTLP goes over HTTP/protobuf and reads its own OTEL_EXPORTER_OTLP_* settings.
- ``trace_file`` (HALFMOON_TRACE_FILE): additionally append every span to that JSONL file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from halfmoon.telemetry.jsonl import JsonlSpanExporter

_TRUE = {"1", "true", "yes", "on"}


def _otlp_traces_endpoint(env: Mapping[str, str]) -> str:
    if traces := env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return traces
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318")
    return base.rstrip("/") + "/v1/traces"


def _exporters_from_env(env: Mapping[str, str]) -> list[SpanExporter]:
    names = env.get("OTEL_TRACES_EXPORTER")
    if names is None:
        has_endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        names = "otlp" if has_endpoint else "none"
    exporters: list[SpanExporter] = []
    for name in (n.strip().lower() for n in names.split(",")):
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter(endpoint=_otlp_traces_endpoint(env)))
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name not in ("none", ""):
            raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter {name!r} (use otlp, console or none)")
    return exporters


def setup_tracing(
    service: str, instance_id: str, trace_file: str | None = None, env: Mapping[str, str] | None = None
) -> TracerProvider:
    """A tracer provider for one service instance; the caller owns it and must ``shutdown()`` it.

    It is not installed globally here: ``run_service`` does that for a real process, while
    tests may run several services in one process, each with its own provider.
    """
    env = os.environ if env is None else env
    resource = Resource.create({"service.name": service, "service.instance.id": instance_id})
    provider = TracerProvider(resource=resource)
    if env.get("OTEL_SDK_DISABLED", "").lower() in _TRUE:
        return provider
    exporters = _exporters_from_env(env)
    if trace_file:
        exporters.append(JsonlSpanExporter(trace_file))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
