"""Tracing for every service: OpenTelemetry setup, JSONL export, NATS header propagation."""

from halfmoon.telemetry.jsonl import JsonlSpanExporter, read_spans, span_record
from halfmoon.telemetry.propagation import extract_context, inject_headers
from halfmoon.telemetry.tracing import setup_tracing

__all__ = ["JsonlSpanExporter", "extract_context", "inject_headers", "read_spans", "setup_tracing", "span_record"]
