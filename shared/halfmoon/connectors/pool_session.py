"""A synchronous engine's way into the pool: NATS and the transfer clients on a loop thread of their own.

Another engine's KV connector (vLLM's, connectors/vllm.py) is called from that engine's threads, not
from an asyncio loop; it hands each pool operation to this session's loop and waits for the answer.
It connects as the ``kv-client`` NATS user (protocol/permissions.py: the pool protocol, nothing else)
with the same HALFMOON_* settings every service reads, which the engine's own config may override.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import threading
import uuid
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from nats.aio.client import Client as NATS

from halfmoon.core.block_format import BlockLayout
from halfmoon.protocol.base import Codec, ErrorReply, Message
from halfmoon.protocol.permissions import KV_CLIENT
from halfmoon.runtime import rpc
from halfmoon.runtime.config import ServiceConfig, load_config
from halfmoon.runtime.host import connect_nats
from halfmoon.runtime.pool_client import PoolClient
from halfmoon.transfer.client import TransferClient

T = TypeVar("T")
Rep = TypeVar("Rep")
CONNECTION_FIELDS = frozenset({"nats_url", "namespace", "nats_user", "nats_password", "nats_tls_ca", "nats_tls_cert",
                               "nats_tls_key", "cluster_secret", "cluster_secret_file", "connect_timeout_s"})


def session_config(overrides: Mapping[str, Any], env: Mapping[str, str] | None = None) -> ServiceConfig:
    """The connection settings: HALFMOON_* variables, then ``overrides`` (the engine's connector config);
    any other key in ``overrides`` that names a connection setting is refused, so a typo is loud."""
    unknown = {k for k in overrides if k not in CONNECTION_FIELDS}
    if unknown:
        raise ValueError(f"unknown Halfmoon connection settings {sorted(unknown)}; known: {sorted(CONNECTION_FIELDS)}")
    config = load_config(ServiceConfig, argv=[], env=os.environ if env is None else env, prog="halfmoon connector")
    return dataclasses.replace(config, **{k: type(getattr(config, k))(v) for k, v in overrides.items()})


class PoolSession:
    """Contract: every method but ``close`` may be called from any thread but the session's own; each
    runs one pool operation to its end on the loop thread and returns its result (the pool client's
    own degradations: a miss, not an error, when the pool is unreachable). ``close`` stops the thread.
    ``user`` is the NATS role it connects as (its reply inbox): ``kv-client``, or a Halfmoon engine service's
    own role where vLLM is that service's engine."""

    def __init__(self, config: ServiceConfig, layout: BlockLayout, name: str, user: str = KV_CLIENT) -> None:
        self.config = config
        self.instance_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.subjects = config.subjects
        self.log = logging.getLogger(f"halfmoon.connector.{name}")
        keys = config.cluster_keys()
        if keys.insecure:
            self.log.warning("no cluster secret (HALFMOON_CLUSTER_SECRET[_FILE] or the connector's cluster_secret): "
                             "blocks are sealed with the public development key")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"halfmoon-{name}", daemon=True)
        self._thread.start()
        self._nc: NATS | None = None
        self.transfer = TransferClient(keys=keys)
        self.pool = PoolClient(self, self.transfer, layout.keyed(keys.kv_mac))
        self._nc = self.run(connect_nats(config, self.instance_id, user), config.connect_timeout_s + 5)

    def run(self, work: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``work`` on the session's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout)

    def submit(self, work: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``work`` on the session's loop; the caller waits on the returned future when it needs it."""
        return asyncio.run_coroutine_threadsafe(work, self._loop)

    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the session's loop, soon (from any thread): how another thread feeds its queues."""
        self._loop.call_soon_threadsafe(callback)

    async def request(self, subject: str, message: Message, reply_codec: Codec[Rep | ErrorReply],
                      timeout: float) -> Rep:
        assert self._nc is not None, "requests run after the connection is up"
        return await rpc.request(self._nc, subject, message, reply_codec, timeout)

    def close(self) -> None:
        async def shut() -> None:
            await self.transfer.close()
            if self._nc is not None:
                await self._nc.close()
        try:
            self.run(shut(), 10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
