"""`halfmoon trace`: one request's waterfall, or the slowest recent requests, in the terminal.

Spans come from the embedded default (the JSONL file `halfmoon up` writes) or Jaeger's query API.
"""

from __future__ import annotations

import argparse
import datetime as dt
from typing import TYPE_CHECKING, NamedTuple

from halfmoon.cli.trace_sources import (
    REQUEST_ID,
    JaegerSource,
    JsonlSource,
    Span,
    SpanSource,
    TraceSourceError,
)

if TYPE_CHECKING:
    from rich.console import Console, JustifyMethod

DEFAULT_TRACE_FILE = ".halfmoon/traces.jsonl"
BAR_WIDTH = 40
PIPED_WIDTH = 220
_HIDDEN = {REQUEST_ID}


class TraceNotFound(LookupError):
    """No request root span carries this request id."""


class Hop(NamedTuple):
    span: Span
    depth: int
    offset_ms: float
    duration_ms: float


class Waterfall(NamedTuple):
    request_id: str
    trace_id: str
    started: dt.datetime
    total_ms: float
    hops: list[Hop]


class RequestSummary(NamedTuple):
    request_id: str
    trace_id: str
    total_ms: float
    started: dt.datetime
    status: str


def _when(ns: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC)


def build_waterfall(spans: list[Span], request_id: str) -> Waterfall:
    """The request's spans as a tree in start order, times relative to its gateway span."""
    root = next((s for s in spans if s.service == "gateway" and s.attributes.get(REQUEST_ID) == request_id), None)
    if root is None:
        raise TraceNotFound(f"no trace holds request {request_id!r}")
    ours = [s for s in spans if s.trace_id == root.trace_id]
    ids = {s.span_id for s in ours}
    children: dict[str | None, list[Span]] = {}
    for span in ours:
        # a span whose parent is not here (not exported yet, or the client's own) hangs off the root
        parent = span.parent_id if span.parent_id in ids else (None if span is root else root.span_id)
        children.setdefault(parent, []).append(span)
    hops: list[Hop] = []

    def walk(span: Span, depth: int) -> None:
        hops.append(Hop(span, depth, (span.start_ns - root.start_ns) / 1e6, span.duration_ns / 1e6))
        for child in sorted(children.get(span.span_id, []), key=lambda s: (s.start_ns, s.span_id)):
            walk(child, depth + 1)

    for top in sorted(children.get(None, []), key=lambda s: s.start_ns):
        walk(top, 0)
    return Waterfall(request_id, root.trace_id, _when(root.start_ns), root.duration_ns / 1e6, hops)


def slowest(roots: list[Span], count: int) -> list[RequestSummary]:
    ranked = sorted(roots, key=lambda s: s.duration_ns, reverse=True)[:count]
    return [
        RequestSummary(str(s.attributes[REQUEST_ID]), s.trace_id, s.duration_ns / 1e6, _when(s.start_ns), s.status)
        for s in ranked
    ]


def bar(offset_ms: float, duration_ms: float, total_ms: float, width: int = BAR_WIDTH) -> str:
    """``···███···``: where a hop falls inside the request, at least one cell wide."""
    scale = width / total_ms if total_ms > 0 else 0.0
    start = min(width - 1, max(0, int(offset_ms * scale)))
    length = max(1, min(width - start, round(duration_ms * scale)))
    return "·" * start + "█" * length + "·" * (width - start - length)


def key_attributes(span: Span) -> str:
    shown = sorted(
        (k.removeprefix("halfmoon."), v)
        for k, v in span.attributes.items()
        if k.startswith("halfmoon.") and k not in _HIDDEN
    )
    text = " ".join(f"{k}={v}" for k, v in shown)
    return f"ERROR {text}".rstrip() if span.status == "ERROR" else text


def render_waterfall(fall: Waterfall, console: Console) -> None:
    from rich.table import Table

    console.print(
        f"[bold]request[/] {fall.request_id}  [bold]trace[/] {fall.trace_id}  "
        f"[bold]total[/] {fall.total_ms:.2f} ms  [bold]started[/] {fall.started:%Y-%m-%d %H:%M:%S.%f} UTC",
        soft_wrap=True,
    )
    table = Table(box=None, pad_edge=False, header_style="bold")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("start ms", "right"),
        ("dur ms", "right"),
        ("timeline", "left"),
        ("service", "left"),
        ("instance", "left"),
        ("span", "left"),
        ("attributes", "left"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name != "attributes")
    for hop in fall.hops:
        s = hop.span
        style = "red" if s.status == "ERROR" else None
        table.add_row(
            f"{hop.offset_ms:.2f}",
            f"{hop.duration_ms:.2f}",
            bar(hop.offset_ms, hop.duration_ms, fall.total_ms),
            s.service,
            s.instance,
            "  " * hop.depth + s.name,
            key_attributes(s),
            style=style,
        )
        for event in s.events:  # migrations, lost instances, resumes: the story inside the span
            offset = (event.time_ns - s.start_ns) / 1e6 + hop.offset_ms
            attrs = " ".join(f"{k.removeprefix('halfmoon.')}={v}" for k, v in event.attributes.items())
            table.add_row(f"{offset:.2f}", "", bar(offset, 0.0, fall.total_ms), "", "",
                          "  " * (hop.depth + 1) + f"! {event.name}", attrs, style="yellow")
    console.print(table)


def render_slowest(rows: list[RequestSummary], console: Console) -> None:
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("request id", "left"),
        ("total ms", "right"),
        ("started (UTC)", "left"),
        ("status", "left"),
        ("trace id", "left"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True, min_width=len(name))
    for row in rows:
        table.add_row(
            row.request_id, f"{row.total_ms:.2f}", f"{row.started:%Y-%m-%d %H:%M:%S.%f}", row.status, row.trace_id
        )
    console.print(table)


def source_of(args: argparse.Namespace) -> SpanSource:
    return JaegerSource(args.jaeger, args.lookback) if args.jaeger else JsonlSource(args.trace_file)


def _trace(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(width=args.width)
    if args.width is None and not console.is_terminal:  # piped: keep rows whole rather than 80 columns wide
        console = Console(width=PIPED_WIDTH)
    errors = Console(stderr=True)
    if (args.request_id is None) == (args.slowest is None):
        errors.print("give either a REQUEST_ID or --slowest N")
        return 2
    try:
        source = source_of(args)
        if args.slowest is not None:
            rows = slowest(source.recent_roots(args.recent), args.slowest)
            if not rows:
                errors.print("no requests traced yet")
                return 1
            render_slowest(rows, console)
        else:
            render_waterfall(build_waterfall(source.request_trace(args.request_id), args.request_id), console)
    except (TraceSourceError, TraceNotFound) as exc:
        errors.print(f"[red]{exc}[/]")
        return 1
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    cmd = subparsers.add_parser("trace", help="show a request's waterfall, or the slowest recent requests")
    cmd.add_argument("request_id", nargs="?", help="request id (the x-request-id response header)")
    cmd.add_argument("--slowest", type=_positive, metavar="N", help="list the N slowest recent requests")
    cmd.add_argument("--recent", type=_positive, default=1000, help="how many recent requests --slowest ranks")
    cmd.add_argument("--trace-file", default=DEFAULT_TRACE_FILE, help="JSONL span file (the embedded default)")
    cmd.add_argument("--jaeger", metavar="URL", help="read spans from Jaeger's query API (e.g. http://jaeger:16686)")
    cmd.add_argument("--lookback", default="1h", help="how far back Jaeger searches")
    cmd.add_argument("--width", type=_positive, help="output width (default: the terminal's)")
    cmd.set_defaults(func=_trace)
