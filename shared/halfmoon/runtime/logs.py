"""Structured logging on stderr, tagged with service and instance: one JSON object per line, or for
people (``halfmoon up``'s logs) a text line ending in the same fields as ``key=value``."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

# attributes every LogRecord has; anything else came from ``extra=`` and is logged as a field
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """What the call passed in ``extra=``: the request id, the reason, the instance..."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str, instance_id: str) -> None:
        super().__init__()
        self._static = {"service": service, "instance": instance_id}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **self._static,
        }
        entry.update(fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """``time LEVEL service/instance logger: message key=value ...``; a value with spaces is quoted."""

    def __init__(self, service: str, instance_id: str) -> None:
        super().__init__(f"%(asctime)s %(levelname)s {service}/{instance_id} %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # the line before any traceback
        extra = " ".join(f"{k}={_text_value(v)}" for k, v in fields(record).items())
        return f"{super().formatMessage(record)} {extra}" if extra else super().formatMessage(record)


def _text_value(value: object) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c.isspace() or c in "\"=" for c in text) else text


def setup_logging(service: str, instance_id: str, level: str = "INFO", fmt: str = "json") -> None:
    """Route the root logger to stderr in ``fmt`` ("json" or "text")."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service, instance_id))
    else:
        handler.setFormatter(TextFormatter(service, instance_id))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
