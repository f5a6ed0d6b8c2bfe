"""Where `halfmoon trace` reads spans: the embedded JSONL file, or Jaeger's query API.

Both give :class:`Span` records in the JSONL schema of :mod:`halfmoon.telemetry.jsonl`; `halfmoon plan`
turns the JSONL file's requests into a trace.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from halfmoon.sim.trace import TraceRequest

REQUEST_ID = "halfmoon.request_id"


class TraceSourceError(Exception):
    """The spans could not be read (missing file, unreachable or malformed Jaeger)."""


class SpanEvent(NamedTuple):
    """Something that happened inside a span (a migration, an instance lost), at ``time_ns``."""

    name: str
    time_ns: int
    attributes: dict[str, Any]


class Span(NamedTuple):
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    instance: str
    start_ns: int
    end_ns: int
    status: str
    attributes: dict[str, Any]
    events: tuple[SpanEvent, ...] = ()

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Span:
        """One line of the JSONL span file."""
        return cls(
            record["trace_id"],
            record["span_id"],
            record.get("parent_id"),
            record["name"],
            record.get("service") or "?",
            record.get("instance") or "",
            int(record["start_ns"]),
            int(record["end_ns"]),
            record.get("status") or "UNSET",
            dict(record.get("attributes") or {}),
            tuple(SpanEvent(e["name"], int(e["time_ns"]), dict(e.get("attributes") or {}))
                  for e in record.get("events") or ()),
        )


def is_request_root(span: Span) -> bool:
    """The gateway span that stands for one client request."""
    return span.service == "gateway" and REQUEST_ID in span.attributes


class SpanSource(ABC):
    """Contract: ``request_trace`` returns every span of the trace holding the request (empty if
    unknown); ``recent_roots`` returns request root spans (see :func:`is_request_root`), newest
    first where the source knows order. Failures to read raise :class:`TraceSourceError`."""

    @abstractmethod
    def request_trace(self, request_id: str) -> list[Span]: ...

    @abstractmethod
    def recent_roots(self, limit: int) -> list[Span]: ...


class JsonlSource(SpanSource):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def spans(self) -> list[Span]:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise TraceSourceError(f"cannot read spans from {self.path}: {exc.strerror or exc}") from None
        spans = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                spans.append(Span.from_record(json.loads(line)))
            except (ValueError, KeyError, TypeError) as exc:
                # NOTE: a writer may be mid-line at the end of the file; anything else is corruption
                if number == len(lines):
                    continue
                raise TraceSourceError(f"{self.path}:{number}: not a span record ({exc!r})") from None
        return spans

    def request_trace(self, request_id: str) -> list[Span]:
        spans = self.spans()
        traces = {s.trace_id for s in spans if s.attributes.get(REQUEST_ID) == request_id and is_request_root(s)}
        return [s for s in spans if s.trace_id in traces]

    def recent_roots(self, limit: int) -> list[Span]:
        roots = [s for s in self.spans() if is_request_root(s)]
        return sorted(roots, key=lambda s: s.start_ns, reverse=True)[:limit]


def _tag_value(tag: Mapping[str, Any]) -> Any:
    value = tag.get("value")
    if tag.get("type") == "int64" and isinstance(value, str):
        return int(value)
    if tag.get("type") == "float64" and isinstance(value, str):
        return float(value)
    return value


def _jaeger_event(log: Mapping[str, Any]) -> SpanEvent:
    fields = {f["key"]: _tag_value(f) for f in log.get("fields") or []}
    return SpanEvent(str(fields.pop("event", "event")), int(log["timestamp"]) * 1000, fields)


def parse_jaeger(document: Mapping[str, Any]) -> list[Span]:
    """Spans of a Jaeger query API reply (``{"data": [{"traceID", "spans", "processes"}, ...]}``)."""
    try:
        spans = []
        for trace in document.get("data") or []:
            processes = trace.get("processes") or {}
            for raw in trace["spans"]:
                process = processes.get(raw.get("processID"), {})
                process_tags = {t["key"]: _tag_value(t) for t in process.get("tags") or []}
                tags = {t["key"]: _tag_value(t) for t in raw.get("tags") or []}
                parents = [
                    r["spanID"]
                    for r in raw.get("references") or []
                    if r.get("refType") == "CHILD_OF" and r.get("traceID") == raw["traceID"]
                ]
                status = str(tags.pop("otel.status_code", "UNSET")).upper()
                if tags.pop("error", False) is True and status == "UNSET":
                    status = "ERROR"
                attributes = {
                    k: v for k, v in tags.items() if not k.startswith(("otel.", "span.kind", "internal.span.format"))
                }
                start_ns = int(raw["startTime"]) * 1000  # Jaeger keeps microseconds
                spans.append(
                    Span(
                        trace_id=raw["traceID"].rjust(32, "0"),
                        span_id=raw["spanID"].rjust(16, "0"),
                        parent_id=parents[0].rjust(16, "0") if parents else None,
                        name=raw["operationName"],
                        service=process.get("serviceName") or "?",
                        instance=str(process_tags.get("service.instance.id", "")),
                        start_ns=start_ns,
                        end_ns=start_ns + int(raw["duration"]) * 1000,
                        status=status,
                        attributes=attributes,
                        events=tuple(_jaeger_event(log) for log in raw.get("logs") or ()),
                    )
                )
        return spans
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TraceSourceError(f"not a Jaeger traces document: {exc!r}") from None


def jaeger_search_params(request_id: str | None, limit: int, lookback: str) -> dict[str, str]:
    """Query of ``GET /api/traces`` for one request's trace, or for recent requests."""
    params = {"service": "gateway", "limit": str(limit), "lookback": lookback}
    if request_id is not None:
        params["tags"] = json.dumps({REQUEST_ID: request_id})
    return params


class JaegerSource(SpanSource):
    def __init__(self, url: str, lookback: str = "1h", timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.lookback = lookback
        self.timeout_s = timeout_s

    def _get(self, path: str, params: Mapping[str, str] | None = None) -> list[Span]:
        import httpx

        try:
            reply = httpx.get(self.url + path, params=params, timeout=self.timeout_s)
            reply.raise_for_status()
            return parse_jaeger(reply.json())
        except (httpx.HTTPError, ValueError) as exc:
            raise TraceSourceError(f"Jaeger query {self.url}{path} failed: {exc}") from None

    def request_trace(self, request_id: str) -> list[Span]:
        found = self._get("/api/traces", jaeger_search_params(request_id, 1, self.lookback))
        trace_ids = {s.trace_id for s in found if s.attributes.get(REQUEST_ID) == request_id}
        return [span for trace_id in sorted(trace_ids) for span in self._get(f"/api/traces/{trace_id}")]

    def recent_roots(self, limit: int) -> list[Span]:
        found = self._get("/api/traces", jaeger_search_params(None, limit, self.lookback))
        roots = [s for s in found if is_request_root(s)]
        return sorted(roots, key=lambda s: s.start_ns, reverse=True)[:limit]


def logged_requests(spans: list[Span], block_size: int) -> tuple[list[TraceRequest], int]:
    """The requests a deployment served, as trace requests, and how many roots lacked a length.

    Arrival is the gateway span's start, the prompt its ``halfmoon.prompt_tokens``, the output the first
    token plus what the decode spans generated. Spans do not name prompt blocks, so every request gets
    blocks of its own: no prefix reuse, which overstates prefill work.
    """
    generated: dict[str, int] = {}
    for span in spans:
        if span.service == "decode" and "halfmoon.tokens_generated" in span.attributes:
            generated[span.trace_id] = generated.get(span.trace_id, 0) + int(span.attributes["halfmoon.tokens_generated"])
    roots = sorted((s for s in spans if is_request_root(s)), key=lambda s: s.start_ns)
    out: list[TraceRequest] = []
    skipped, next_block = 0, 0
    for root in roots:
        prompt = root.attributes.get("halfmoon.prompt_tokens")
        if not isinstance(prompt, int) or prompt < 1 or root.trace_id not in generated:
            skipped += 1
            continue
        blocks = -(-prompt // block_size)
        out.append(TraceRequest((root.start_ns - roots[0].start_ns) / 1e9, prompt, 1 + generated[root.trace_id],
                                tuple(range(next_block, next_block + blocks))))
        next_block += blocks
    return out, skipped
