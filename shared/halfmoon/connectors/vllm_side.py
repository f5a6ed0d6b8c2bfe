"""What both sides of the Halfmoon connector (connectors/vllm.py) start with, in whichever vLLM process
loads it: the connector's settings, the KV as the pool's blocks hold it, a session to the pool, a tracer
and the counts vLLM's statistics take."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from opentelemetry import context as otel_context
from opentelemetry.trace import Tracer

from halfmoon.connectors.pool_session import CONNECTION_FIELDS, PoolSession, session_config
from halfmoon.connectors.vllm_stats import StatsCounter
from halfmoon.core.block_format import BlockLayout
from halfmoon.core.kv_spec import describe
from halfmoon.engine.vllm_engine import kv_spec_of
from halfmoon.protocol.permissions import KV_CLIENT
from halfmoon.telemetry.propagation import extract_context
from halfmoon.telemetry.tracing import setup_tracing

if TYPE_CHECKING:
    from vllm.config import VllmConfig

T = TypeVar("T")
DEFAULT_BLOCK_SIZE = 16  # Halfmoon's engine's default (engine/config.py): the pool's blocks are shared with it
POOL_FIELDS = frozenset({"block_size", "cache_salt", "nats_role", "exit_with_parent"})
POOL_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# both sides' spans under one instrumentation scope: the module users configure vLLM to load
TRACER_NAME = "halfmoon.connectors.vllm"
log = logging.getLogger("vllm.halfmoon")  # under vLLM's logger, so its handlers print it


def exit_with_parent() -> None:
    """This process (vLLM's engine core, or its worker) gets SIGTERM when the one that started it exits.
    Under Halfmoon's services (engine/vllm_engine.py) vLLM's engine core is the service's child, and it
    does not watch its parent: a SIGKILLed service left it running, holding the model, its KV cache and
    its NATS connections."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        log.warning("HalfmoonConnector: prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    elif os.getppid() == 1:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


class ConnectorSide:
    """Contract: one per vLLM process that loads the connector, built by ``HalfmoonConnector`` as the side
    of its role (``name``: ``vllm-scheduler`` or ``vllm-worker``, the session's instance name). It reads
    ``kv_connector_extra_config`` (unknown keys refused), refuses a model the pool's block format cannot
    carry, arms ``exit_with_parent`` where asked, and owns the side's ``PoolSession`` (as the configured
    NATS role), its tracer provider and its ``StatsCounter``; ``shutdown`` ends the session and the
    provider. Every pool operation of a side runs on that session's loop."""

    def __init__(self, vllm_config: VllmConfig, name: str) -> None:
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None, "KVConnectorBase_V1 refuses a config without one"
        extra = dict(transfer_config.kv_connector_extra_config or {})
        unknown = set(extra) - POOL_FIELDS - CONNECTION_FIELDS
        if unknown:
            raise ValueError(f"HalfmoonConnector: unknown kv_connector_extra_config keys {sorted(unknown)}; known: "
                             f"{sorted(POOL_FIELDS | CONNECTION_FIELDS)}")
        self.block_size = int(extra.get("block_size", DEFAULT_BLOCK_SIZE))
        self.cache_salt: str | None = extra.get("cache_salt")
        self.vllm_block_size: int = vllm_config.cache_config.block_size
        self.spec = kv_spec_of(vllm_config, self.block_size)
        self.layout = BlockLayout.of(self.spec)
        if self.block_size != self.vllm_block_size:
            log.warning("HalfmoonConnector: pool blocks of %d tokens, vLLM blocks of %d: blocks move by token "
                        "position (same-size blocks copy fastest)", self.block_size, self.vllm_block_size)
        if transfer_config.kv_load_failure_policy != "recompute":
            log.warning("HalfmoonConnector: kv_load_failure_policy is %r: a pool block that fails its MAC or "
                        "vanishes fails its request; set it to \"recompute\" to recompute it instead",
                        transfer_config.kv_load_failure_policy)
        if extra.get("exit_with_parent"):
            exit_with_parent()
        config = session_config({k: v for k, v in extra.items() if k in CONNECTION_FIELDS})
        user = str(extra.get("nats_role", KV_CLIENT))
        self.session = PoolSession(config, self.layout, name, user=user)
        # spans go where the service's go (HALFMOON_TRACE_FILE, OTEL_*), under the service's name
        self._tracing = setup_tracing("vllm" if user == KV_CLIENT else user, self.session.instance_id,
                                      config.trace_file or None)
        self.tracer: Tracer = self._tracing.get_tracer(TRACER_NAME)
        self.stats = StatsCounter()
        log.info("HalfmoonConnector (%s) on %s namespace %s: KV %s", name, config.nats_url, config.namespace,
                 describe(self.spec))

    async def traced(self, trace: dict[str, str], name: str, work: Awaitable[T], request_id: str) -> T:
        """``work`` in a span of the request's trace, so the pool's spans (cache-manager, transfer) join it."""
        attached = otel_context.attach(extract_context(trace))
        try:
            with self.tracer.start_as_current_span(name, attributes={"halfmoon.request_id": request_id}):
                return await work
        finally:
            otel_context.detach(attached)

    def shutdown(self) -> None:
        self.session.close()
        self._tracing.shutdown()
