"""W3C trace-context in NATS headers, so every hop continues the sender's trace."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()


def inject_headers(headers: dict[str, str] | None = None, context: Context | None = None) -> dict[str, str]:
    """``headers`` plus ``traceparent``/``tracestate`` of ``context`` (default: the current one)."""
    carrier = dict(headers or {})
    _propagator.inject(carrier, context=context)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> Context:
    """The remote parent carried by ``headers``; an empty context when there is none."""
    return _propagator.extract(dict(headers or {}))
