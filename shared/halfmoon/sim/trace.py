"""Request traces in the Mooncake FAST'25 JSONL format."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple


class TraceFormatError(ValueError):
    """A trace line is not a valid request; the message names the source and line."""


class TraceRequest(NamedTuple):
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_line(line: str, where: str = "<line>") -> TraceRequest:
    try:
        raw = json.loads(line)
        ts, n_in, n_out, ids = raw["timestamp"], raw["input_length"], raw["output_length"], raw["hash_ids"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise TraceFormatError(f"{where}: not a trace record ({exc})") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (ts, n_in, n_out)):
        raise TraceFormatError(f"{where}: timestamp, input_length and output_length must be integers")
    if ts < 0 or n_in < 1 or n_out < 1:
        raise TraceFormatError(f"{where}: need timestamp >= 0, input_length >= 1, output_length >= 1")
    if not isinstance(ids, list) or not all(isinstance(h, int) for h in ids):
        raise TraceFormatError(f"{where}: hash_ids must be a list of integers")
    return TraceRequest(ts / 1000.0, n_in, n_out, tuple(ids))


def iter_trace(lines: Iterable[str], source: str = "<trace>") -> Iterator[TraceRequest]:
    """Parse non-blank lines; arrival times must not decrease."""
    last = 0.0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        req = parse_line(line, f"{source}:{number}")
        if req.arrival_s < last:
            raise TraceFormatError(f"{source}:{number}: timestamp goes backwards")
        last = req.arrival_s
        yield req


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace not found: {path}")
    out: list[TraceRequest] = []
    with path.open(encoding="utf-8") as fh:
        for req in iter_trace(fh, str(path)):
            if limit is not None and len(out) >= limit:
                break
            out.append(req)
    return out
