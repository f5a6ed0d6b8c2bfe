"""The gateway service: OpenAI HTTP API (uvicorn) on one side, NATS serving path on the other."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from opentelemetry.trace import TracerProvider

from halfmoon.core.tenants import KeyRing, TenantSalts, is_loopback
from halfmoon.policy.admission import OVERLOAD_WAIT_S
from halfmoon.protocol.permissions import gateway_of_user, gateway_user
from halfmoon.protocol.registry import Load, Role
from halfmoon.runtime import Service, ServiceConfig
from halfmoon.runtime.config import setting
from halfmoon.services.gateway.app import ApiLimits, GatewayApi
from halfmoon.services.gateway.client import Deadlines, ServingClient
from halfmoon.services.gateway.guard import Guard
from halfmoon.services.gateway.http_limits import BodyIdleTimeout, per_client_protocol
from halfmoon.services.gateway.metrics import GatewayMetrics
from halfmoon.services.gateway.model import ServedModel
from halfmoon.services.gateway.ratelimit import SharedRateLimiter


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    model_dir: str = field(default="", metadata={"help": "model directory (tokenizer, config.json)"})
    model_name: str = field(default="", metadata={"help": "served model id (default: directory name)"})
    max_model_len: int = field(default=0, metadata={"help": "cap the context length (0: the model's)"})
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP listen address"})
    port: int = field(default=8000, metadata={"help": "HTTP port (0: any free port)"})
    max_body_bytes: int = field(default=4 << 20, metadata={"help": "largest accepted request body"})
    body_idle_timeout_s: float = field(default=10.0, metadata={
        "help": "answer 408 and close a connection whose request body sends nothing for this long"})
    max_connections_per_client: int = field(default=64, metadata={
        "help": "open HTTP connections one client address may hold; more are answered 503 and closed"})
    schedule_timeout_s: float = field(default=5.0, metadata={"help": "wait this long for the conductor"})
    submit_timeout_s: float = field(default=5.0, metadata={"help": "wait this long for prefill to accept"})
    ttft_timeout_s: float = field(default=60.0, metadata={"help": "fail if no first token by then"})
    itl_timeout_s: float = field(default=30.0, metadata={"help": "migrate (or fail) if no next token by then"})
    migration_limit: int = field(default=2, metadata={
        "help": "place a request again at most this often when an instance fails it mid-way (0: never)"})
    stall_probe_s: float = field(default=2.0, metadata={
        "help": "a stream quiet this long asks its instances to re-send what NATS may have dropped"})
    instance_wait_s: float = field(default=30.0, metadata={
        "help": "a request finding no live instance of a role waits this long for one (a supervised restart) "
                "before its 429, within ttft_timeout_s (0: at once)"})
    overload_wait_s: float = field(default=OVERLOAD_WAIT_S, metadata={
        "help": "a request the conductor turns away as overloaded, expecting the prompt work queued ahead to "
                "drain within this long, asks again until then (at most a second apart) before its 429; the "
                "conductor counts the wait against the TTFT SLO and stops expecting it to clear once the SLO "
                "would be missed, so the default is that SLO's (0: at once)"})
    api_keys_file: str = field(default="", metadata={
        "help": "API keys, one 'KEY TENANT [RPM] [TPM]' per line (KEY may be sha256:HEX); empty: no keys"})
    auth_secret_file: str = field(default="", metadata={
        "help": "deployment secret the tenants' cache salts are derived from (same file on every replica)"})
    insecure_no_auth: bool = field(default=False, metadata={
        "help": "allow listening beyond loopback without API keys"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model_dir:
            raise ValueError("model_dir is required (--model-dir or HALFMOON_MODEL_DIR)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_connections_per_client < 1:
            raise ValueError(f"max_connections_per_client must be >= 1, got {self.max_connections_per_client}")
        for name in ("schedule_timeout_s", "submit_timeout_s", "ttft_timeout_s", "itl_timeout_s", "stall_probe_s",
                     "body_idle_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("instance_wait_s", "overload_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if self.api_keys_file and self.insecure_no_auth:
            raise ValueError(f"{setting('insecure_no_auth')} does nothing with {setting('api_keys_file')} set: "
                             "keys are required; drop one")
        scoped = gateway_of_user(self.nats_user)
        if self.nats_user and scoped != self.instance_id:
            # NOTE: a gateway user may submit and read streams for its own gateway only: under another id this
            # gateway's submits and streams would all be refused
            fix = (f"run it as {setting('instance_id')}={scoped}" if scoped else
                   f"give it the credentials of {gateway_user(self.instance_id or 'ID')} (a user per gateway)")
            raise ValueError(f"{setting('nats_user')} {self.nats_user!r} is not the NATS user of gateway "
                             f"{self.instance_id or '(no instance_id set)'}: {fix}")
        if not self.api_keys_file and not self.insecure_no_auth and not is_loopback(self.host):
            raise ValueError(f"listening on {self.host} without API keys would open the API to the network: "
                             "set api_keys_file (--api-keys-file, HALFMOON_API_KEYS_FILE) or insecure_no_auth")

    def guard_parts(self) -> tuple[KeyRing | None, TenantSalts]:
        keys = KeyRing.load(self.api_keys_file) if self.api_keys_file else None
        secret = Path(self.auth_secret_file).read_bytes().strip() if self.auth_secret_file else b""
        return keys, TenantSalts(secret)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: the service host owns SIGTERM/SIGINT; uvicorn must not re-raise them
        yield


class GatewayService(Service[GatewayConfig]):
    role = Role.GATEWAY
    config_class = GatewayConfig

    def __init__(self, config: GatewayConfig, tracer_provider: TracerProvider | None = None) -> None:
        super().__init__(config, tracer_provider)
        self.metrics = GatewayMetrics()
        self.served: ServedModel | None = None
        self.client: ServingClient | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._port = config.port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self._port}"

    @property
    def address(self) -> str:
        return self.url

    @property
    def model(self) -> str:
        return self.served.name if self.served else ""

    def load(self) -> Load:
        return Load(running=self.client.in_flight if self.client else 0)

    async def start(self) -> None:
        cfg = self.config
        self.served = await asyncio.to_thread(ServedModel.load, cfg.model_dir, cfg.model_name, cfg.max_model_len)
        deadlines = Deadlines(cfg.schedule_timeout_s, cfg.submit_timeout_s, cfg.ttft_timeout_s, cfg.itl_timeout_s,
                              migration_limit=cfg.migration_limit, stall_probe_s=cfg.stall_probe_s,
                              instance_wait_s=cfg.instance_wait_s, overload_wait_s=cfg.overload_wait_s)
        self.client = ServingClient(self, self.served.name, deadlines)
        await self.client.start()
        keys, salts = await asyncio.to_thread(cfg.guard_parts)
        limited = keys is not None and keys.limited
        limiter = await SharedRateLimiter.open(self.nc, self.subjects, time.time) if limited else None
        if keys is None:
            self.log.warning("no API keys: every request is anonymous", extra={"host": cfg.host})
        api = GatewayApi(
            self.served,
            self.client,
            ApiLimits(cfg.max_body_bytes),
            self.metrics,
            self.tracer,
            accepting=lambda: not self.draining,
            guard=Guard(keys, salts, limiter),
        )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.host, cfg.port))
        self._port = sock.getsockname()[1]
        uv_config = uvicorn.Config(
            BodyIdleTimeout(api.build(), cfg.body_idle_timeout_s),
            http=per_client_protocol(cfg.max_connections_per_client),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=cfg.drain_timeout_s,  # type: ignore[arg-type]  # used as asyncio.timeout's float; typed int
        )
        self._server = _Server(uv_config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="uvicorn")
        self._task.add_done_callback(lambda _t: self.stop_requested.set())
        while not self._server.started:
            if self._task.done():
                await self._task  # raises why it could not start
                raise RuntimeError("HTTP server exited during startup")
            await asyncio.sleep(0.01)
        self.log.info("listening", extra={"url": self.url, "model": self.served.name})

    async def drain(self) -> None:
        """New requests get 503 (``draining``); uvicorn stops accepting and finishes open responses."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
