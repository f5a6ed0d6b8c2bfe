"""``run_service``: the whole ``python -m halfmoon.services.<name>`` entry point in one call."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import uuid
from collections.abc import Sequence

from opentelemetry import trace

from halfmoon.runtime.base import Service
from halfmoon.runtime.config import load_config
from halfmoon.runtime.host import NatsLost, serve_until_signalled
from halfmoon.runtime.logs import setup_logging
from halfmoon.telemetry import setup_tracing


def run_service(service_class: type[Service], argv: Sequence[str] | None = None) -> int:
    """Build the config from env + flags, set up logging and tracing, run until signalled.

    Returns the process exit code: 0 after a graceful stop, 1 if the service failed.
    """
    role = service_class.role.value
    config = load_config(service_class.config_class, argv, prog=f"python -m halfmoon.services.{role.replace('-', '_')}")
    if not config.instance_id:
        config = dataclasses.replace(config, instance_id=f"{role}-{uuid.uuid4().hex[:8]}")
    setup_logging(role, config.instance_id, config.log_level, config.log_format)
    provider = setup_tracing(role, config.instance_id, config.trace_file or None)
    trace.set_tracer_provider(provider)
    try:
        asyncio.run(serve_until_signalled(service_class(config, provider)))
    except NatsLost as exc:
        logging.getLogger("halfmoon.runtime").error(f"exiting: {exc}")
        return 1
    except Exception:
        logging.getLogger("halfmoon.runtime").exception("service failed")
        return 1
    finally:
        provider.shutdown()
    return 0


def main(service_class: type[Service]) -> None:
    code = run_service(service_class)
    if code != 0:
        # A failed service exits now, whatever thread its failure left running (a library's server
        # thread, a stuck executor): a process that hangs here is never restarted by its supervisor.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
