"""The base every service builds on: config, NATS lifecycle, heartbeats, drain, logging."""

from halfmoon.runtime.base import Service
from halfmoon.runtime.config import ServiceConfig, load_config
from halfmoon.runtime.host import ServiceHost, connect_nats, serve_until_signalled
from halfmoon.runtime.rpc import publish, request, serve_requests, subscribe_events
from halfmoon.runtime.runner import main, run_service

__all__ = [
    "Service",
    "ServiceConfig",
    "ServiceHost",
    "connect_nats",
    "load_config",
    "main",
    "publish",
    "request",
    "run_service",
    "serve_requests",
    "serve_until_signalled",
    "subscribe_events",
]
