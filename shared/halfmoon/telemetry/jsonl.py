"""A span exporter that appends one JSON object per span to a file, safe for many writers."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """The JSONL schema: ids as lowercase hex, times in unix nanoseconds."""
    ctx = span.context
    parent = span.parent
    resource = span.resource.attributes
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "service": resource.get("service.name"),
        "instance": resource.get("service.instance.id"),
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": _plain(span.attributes),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": _plain(e.attributes)} for e in span.events],
    }


def _plain(attributes: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attributes or {}).items()}


class JsonlSpanExporter(SpanExporter):
    """Appends finished spans to ``path``.

    Several processes may share one file: each export is a single ``write`` of whole lines
    to an ``O_APPEND`` descriptor under an exclusive ``flock``, so lines never interleave.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> Path:
        return self._path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        data = "".join(json.dumps(span_record(s), separators=(",", ":")) + "\n" for s in spans).encode()
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            return SpanExportResult.FAILURE
        finally:
            os.close(fd)  # closing drops the lock
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_spans(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All span records in a JSONL trace file (for tools and tests)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
