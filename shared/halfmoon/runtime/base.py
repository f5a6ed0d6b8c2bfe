"""The service base: what every Halfmoon service is, whatever its role."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar, Generic, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from opentelemetry import trace
from opentelemetry.trace import TracerProvider

from halfmoon.core.kv_spec import KVSpec
from halfmoon.protocol import codecs
from halfmoon.protocol.base import Codec, ErrorReply, Message
from halfmoon.protocol.registry import (
    Heartbeat,
    InstanceDown,
    KernelReport,
    Load,
    Role,
    down_sender_ok,
    heartbeat_sender_ok,
)
from halfmoon.protocol.subjects import Subjects
from halfmoon.runtime import rpc
from halfmoon.runtime.config import ServiceConfig
from halfmoon.runtime.liveness import NatsLiveness
from halfmoon.runtime.memory import MemoryReport, service_report

C = TypeVar("C", bound=ServiceConfig)
Req = TypeVar("Req")
Rep = TypeVar("Rep")


class Service(ABC, Generic[C]):
    """A thin async shell around one role's core.

    Contract with :class:`~halfmoon.runtime.host.ServiceHost` (which owns the lifecycle):
    ``start()`` runs once NATS is connected and must return promptly after subscribing and
    opening listeners; the host then heartbeats ``load()`` every interval. On shutdown the
    host sets ``draining`` (announced by a heartbeat), awaits ``drain()`` (stop taking work,
    finish or hand back what is held) bounded by ``drain_timeout_s``, publishes InstanceDown,
    awaits ``close()`` and closes NATS. A service that must end by itself (a fatal error)
    sets ``stop_requested``.
    """

    role: ClassVar[Role]
    config_class: ClassVar[type[ServiceConfig]] = ServiceConfig

    def __init__(self, config: C, tracer_provider: TracerProvider | None = None) -> None:
        if not config.instance_id:
            config = dataclasses.replace(config, instance_id=f"{self.role.value}-{uuid.uuid4().hex[:8]}")
        self.config: C = config
        self.instance_id = config.instance_id
        # NOTE: restarts keep the instance id; this tells the runs apart, so news about one never hits the next
        self.incarnation = uuid.uuid4().hex[:12]
        self.subjects = config.subjects
        self.log = logging.getLogger(f"halfmoon.{self.role.value}")
        self.cluster_keys = config.cluster_keys()
        if self.cluster_keys.insecure:
            self.log.warning("no cluster secret (HALFMOON_CLUSTER_SECRET[_FILE]): the data plane uses the public "
                             "development key, so anyone can connect to transfer nodes and forge KV blocks")
        self.tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(f"halfmoon.{self.role.value}")
        self.draining = False
        self.stop_requested = asyncio.Event()
        # NOTE: the host feeds it from the NATS connection; services read it (the gateway's /health)
        self.liveness = NatsLiveness(config.nats_lost_deadline_s, config.nats_give_up_s)
        self._nc: NATS | None = None

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise RuntimeError(f"{self.instance_id} is not connected to NATS (start it with ServiceHost)")
        return self._nc

    def attach(self, nc: NATS) -> None:
        """Give the service its connection; called by the host before ``start``."""
        self._nc = nc

    @property
    def address(self) -> str:
        """How peers reach this instance (a submit subject, ``host:port``); "" if not addressed."""
        return ""

    @property
    def model(self) -> str:
        """The model this instance serves, if any (reported in heartbeats)."""
        return ""

    @property
    def kv_spec(self) -> KVSpec | None:
        """The KV identity of an engine instance (reported in heartbeats); None for other roles."""
        return None

    @property
    def kernels(self) -> KernelReport | None:
        """The CPU kernels an engine instance runs (reported in heartbeats); None for other roles."""
        return None

    @property
    def paces_prompts(self) -> bool:
        """Whether its engine honours a PrefillRequest's ``step_target_s`` (reported in heartbeats)."""
        return False

    def memory_report(self) -> MemoryReport:
        """What bounds this process's resident memory (its ready file carries it, for `halfmoon up`)."""
        return service_report(self.role.value)

    def load(self) -> Load:
        """Current load figures (heartbeats, metrics scrapes); must be cheap and never block."""
        return Load()

    def heartbeat_load(self) -> Load:
        """``load()`` plus what is reported once per heartbeat (an engine's steps since the last)."""
        return self.load()

    @abstractmethod
    async def start(self) -> None:
        """Subscribe and open listeners."""

    async def drain(self) -> None:
        """Finish or hand back the work held; ``draining`` is already true."""

    async def close(self) -> None:
        """Release what ``start`` opened (NATS itself is closed by the host)."""

    # helpers for subclasses

    async def serve(
        self, subject: str, codec: Codec[Req], handler: rpc.RequestHandler[Req], *, span_name: str, queue: str = ""
    ) -> Subscription:
        return await rpc.serve_requests(
            self.nc, subject, codec, handler, tracer=self.tracer, span_name=span_name, log=self.log, queue=queue
        )

    async def serve_addressed(
        self, subject: str, codec: Codec[Req], handler: rpc.AddressedHandler[Req], *, span_name: str
    ) -> Subscription:
        return await rpc.serve_addressed_requests(self.nc, subject, codec, handler, tracer=self.tracer,
                                                  span_name=span_name, log=self.log)

    async def listen(
        self, subject: str, codec: Codec[Req], handler: rpc.EventHandler[Req], *, queue: str = ""
    ) -> Subscription:
        return await rpc.subscribe_events(self.nc, subject, codec, handler, log=self.log, queue=queue)

    async def listen_heartbeats(self, handler: rpc.EventHandler[Heartbeat]) -> Subscription:
        """Every role's heartbeats, each only from the role it names (see ``heartbeat_sender_ok``)."""
        return await rpc.subscribe_events(self.nc, self.subjects.heartbeat, codecs.HEARTBEAT, handler, log=self.log,
                                          accept=lambda subject, beat: heartbeat_sender_ok(
                                              Subjects.sender_role(subject), beat))

    async def listen_downs(self, handler: rpc.EventHandler[InstanceDown]) -> Subscription:
        """InstanceDown news, each only from the conductor or the role it names (see ``down_sender_ok``)."""
        return await rpc.subscribe_events(self.nc, self.subjects.down, codecs.DOWN, handler, log=self.log,
                                          accept=lambda subject, down: down_sender_ok(
                                              Subjects.sender_role(subject), down))

    async def publish(self, subject: str, message: Message, headers: Mapping[str, str] | None = None) -> None:
        await rpc.publish(self.nc, subject, message, headers)

    async def request(
        self,
        subject: str,
        message: Message,
        reply_codec: Codec[Rep | ErrorReply],
        timeout: float,
        headers: Mapping[str, str] | None = None,
        responder_grace_s: float = 0.0,
    ) -> Rep:
        return await rpc.request(self.nc, subject, message, reply_codec, timeout, headers, responder_grace_s)
