"""One typed config per service, built from defaults, then HALFMOON_* env vars, then flags.

A service declares ``@dataclass(frozen=True) class MyConfig(ServiceConfig)`` with typed,
defaulted fields (help text in ``field(metadata={"help": ...})``) and validates it in
``__post_init__``; :func:`load_config` turns every field ``foo_bar`` into the flag
``--foo-bar`` and the variable ``HALFMOON_FOO_BAR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import ssl
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from halfmoon.core.cluster_keys import ClusterKeys, load_secret
from halfmoon.protocol.subjects import Subjects, check_token

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_PREFIX = "HALFMOON_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def setting(name: str) -> str:
    """A config field as an error message names it: the variable an operator sets, then the field."""
    return f"{ENV_PREFIX}{name.upper()} ({name})"


def changed(config: DataclassInstance, *names: str) -> list[str]:
    """Those of the dataclass ``config``'s fields ``names`` set away from their defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    return [name for name in names if getattr(config, name) != defaults[name]]


def require_for(config: DataclassInstance, names: Sequence[str], present: bool, what: str) -> None:
    """Fail loudly where any of ``names`` is set while ``what`` (``present``) is not: without it they do nothing."""
    idle = [] if present else changed(config, *names)
    if idle:
        raise ValueError(f"{', '.join(map(setting, idle))} {'does' if len(idle) == 1 else 'do'} nothing "
                         f"without {what}")


@dataclass(frozen=True)
class ServiceConfig:
    """Settings every service has; defaults run everything on one machine."""

    nats_url: str = field(default="nats://127.0.0.1:4222", metadata={"help": "NATS server URL(s), comma separated"})
    namespace: str = field(default="halfmoon", metadata={"help": "subject namespace of this deployment"})
    instance_id: str = field(default="", metadata={"help": "unique instance id (default: <role>-<random>)"})
    heartbeat_interval_s: float = field(default=1.0, metadata={"help": "seconds between heartbeats"})
    drain_timeout_s: float = field(default=30.0, metadata={"help": "max seconds to finish work on SIGTERM"})
    connect_timeout_s: float = field(default=30.0, metadata={"help": "give up if NATS is unreachable this long"})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})
    log_format: str = field(default="json", metadata={"help": "json (one object per line) or text"})
    trace_file: str = field(default="", metadata={"help": "append spans to this JSONL file"})
    metrics_port: int = field(
        default=0, metadata={"help": "serve Prometheus /metrics on this port (0: off, -1: any free port)"}
    )
    metrics_host: str = field(default="127.0.0.1", metadata={
        "help": "address the /metrics endpoint listens on (0.0.0.0 in containers)"})
    nats_user: str = field(default="", metadata={"help": "NATS user of this service's role (empty: none)"})
    nats_password: str = field(default="", metadata={"help": "NATS password of nats_user"})
    nats_tls_ca: str = field(default="", metadata={"help": "CA certificate (PEM) to verify the NATS server with"})
    nats_tls_cert: str = field(default="", metadata={"help": "client certificate (PEM) presented to NATS"})
    nats_tls_key: str = field(default="", metadata={"help": "private key (PEM) of nats_tls_cert"})
    cluster_secret: str = field(default="", repr=False, metadata={
        "help": "secret shared by a deployment's services: data-plane handshake, capabilities, KV block MACs "
                "(empty, and no file: a public development key, insecure)"})
    cluster_secret_file: str = field(default="", metadata={"help": "file holding the cluster secret"})
    nats_lost_deadline_s: float = field(default=10.0, metadata={
        "help": "health checks fail once NATS has been unreachable this long"})
    nats_give_up_s: float = field(default=60.0, metadata={
        "help": "exit non-zero (for the supervisor to restart) once NATS has been unreachable this long"})
    ready_file: str = field(default="", metadata={
        "help": "once serving, write this instance's pid and the ports it bound (JSON) to this file"})

    def __post_init__(self) -> None:
        Subjects(self.namespace)  # validates
        if self.instance_id:
            check_token(self.instance_id, "instance_id")
        for name in ("heartbeat_interval_s", "drain_timeout_s", "connect_timeout_s", "nats_lost_deadline_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.nats_give_up_s < self.nats_lost_deadline_s:
            raise ValueError(f"nats_give_up_s ({self.nats_give_up_s}) must be at least nats_lost_deadline_s "
                             f"({self.nats_lost_deadline_s})")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be -1 (any free port), 0 (off) or a port, got {self.metrics_port}")
        if self.log_format not in ("json", "text"):
            raise ValueError(f"log_format must be json or text, got {self.log_format!r}")
        if bool(self.nats_user) != bool(self.nats_password):
            raise ValueError(f"{setting('nats_user')} and {setting('nats_password')} go together")
        if bool(self.nats_tls_cert) != bool(self.nats_tls_key):
            raise ValueError(f"{setting('nats_tls_cert')} and {setting('nats_tls_key')} go together")
        require_for(self, ["nats_tls_cert"], bool(self.nats_tls_ca), f"{setting('nats_tls_ca')} to verify the server")
        require_for(self, ["metrics_host"], self.metrics_port != 0, f"{setting('metrics_port')} (0: off)")
        if self.cluster_secret and self.cluster_secret_file:
            raise ValueError(f"set {setting('cluster_secret')} or {setting('cluster_secret_file')}, not both")
        for name in ("nats_tls_ca", "nats_tls_cert", "nats_tls_key"):
            if getattr(self, name) and not os.path.isfile(getattr(self, name)):
                raise ValueError(f"{name}: no such file {getattr(self, name)!r}")
        self.cluster_keys()  # validates (readable file, long enough)

    def nats_tls(self) -> ssl.SSLContext | None:
        """The TLS context for NATS: verify the server against nats_tls_ca, present the client cert if set."""
        if not self.nats_tls_ca:
            return None
        context = ssl.create_default_context(cafile=self.nats_tls_ca)
        if self.nats_tls_cert:
            context.load_cert_chain(self.nats_tls_cert, self.nats_tls_key)
        return context

    def cluster_keys(self) -> ClusterKeys:
        return ClusterKeys.from_secret(load_secret(self.cluster_secret, self.cluster_secret_file))

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.namespace)


C = TypeVar("C", bound=ServiceConfig)


def _base_type(hint: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of a field annotation such as ``int`` or ``str | None``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported config field type {hint}")
        return args[0], True
    return hint, False


def _parse(raw: str, hint: Any, source: str) -> Any:
    kind, optional = _base_type(hint)
    if optional and raw.lower() in ("", "none"):
        return None
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}")
        return kind(raw)
    except ValueError as exc:
        raise ValueError(f"{source}: cannot read {raw!r} as {kind.__name__}: {exc}") from None


def load_config(
    cls: type[C], argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, prog: str | None = None
) -> C:
    """Build ``cls`` from its defaults, overridden by ``env``, overridden by ``argv`` flags.

    Raises ``SystemExit(2)`` with a usage message for unknown flags or invalid values.
    """
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = hints[f.name]
        var = ENV_PREFIX + f.name.upper()
        helptext = f"{f.metadata.get('help', '')} (env {var})"
        flag = "--" + f.name.replace("_", "-")
        if _base_type(hint)[0] is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=helptext)
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(), help=helptext)
        if var in env:
            try:
                values[f.name] = _parse(env[var], hint, var)
            except ValueError as exc:
                parser.error(str(exc))
    args = parser.parse_args(argv)
    for f in dataclasses.fields(cls):
        raw = getattr(args, f.name, None)
        if raw is None:
            continue
        try:
            values[f.name] = (
                raw if isinstance(raw, bool) else _parse(raw, hints[f.name], "--" + f.name.replace("_", "-"))
            )
        except ValueError as exc:
            parser.error(str(exc))
    try:
        return cls(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
