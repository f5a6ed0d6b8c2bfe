"""NATS users for a deployment: one per service role with the subject permissions of
``halfmoon.protocol.permissions``, plus the operator (``admin``); the nats-server config that
enforces them, and the environment that hands each service its own credentials.

Files are written with mode 0600: whoever can read them can act as any role.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from halfmoon.protocol.permissions import ADMIN, KV_CLIENT, inbox_prefix, role_permissions
from halfmoon.protocol.registry import Role
from halfmoon.protocol.subjects import Subjects

ROLES: tuple[str, ...] = (*(r.value for r in Role), KV_CLIENT, ADMIN)


def write_private(path: Path, text: str) -> Path:
    """Create (or replace) ``path`` readable by its owner only, never world-readable even briefly."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its old mode through O_CREAT
    return path


@dataclass(frozen=True)
class TlsFiles:
    """Server side of NATS TLS (``halfmoon certs`` writes these); clients must present a cert the CA signed."""

    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class NatsAuth:
    namespace: str
    passwords: dict[str, str]  # role (or admin) -> password

    @classmethod
    def generate(cls, namespace: str) -> NatsAuth:
        return cls(namespace, {role: secrets.token_urlsafe(24) for role in ROLES})

    @classmethod
    def load(cls, path: Path) -> NatsAuth:
        data = json.loads(path.read_text())
        return cls(data["namespace"], data["passwords"])

    def save(self, path: Path) -> Path:
        return write_private(path, json.dumps({"namespace": self.namespace, "passwords": self.passwords}, indent=1))

    def user(self, role: str) -> dict:
        perms = role_permissions(Subjects(self.namespace), role)
        return {"user": role, "password": self.passwords[role], "permissions": {
            "publish": {"allow": list(perms.publish)},
            "subscribe": {"allow": list(perms.subscribe)},
            **({"allow_responses": True} if perms.responds else {}),
        }}

    def authorization(self) -> dict:
        """The ``authorization`` block alone: what a server with its own config includes (Kubernetes)."""
        return {"authorization": {"users": [self.user(r) for r in ROLES]}}

    def server_config(self, host: str, port: int, store_dir: Path | None, tls: TlsFiles | None = None,
                      monitor_port: int = 0) -> str:
        """A nats-server config (JSON is valid NATS config syntax) admitting only these users; the
        monitoring port (health checks) carries no messages and needs no credentials."""
        config: dict = {"host": host, "port": port, **self.authorization()}
        if monitor_port:
            config["http_port"] = monitor_port
        if store_dir is not None:
            config["jetstream"] = {"store_dir": str(store_dir)}
        if tls is not None:
            config["tls"] = {"ca_file": str(tls.ca), "cert_file": str(tls.cert), "key_file": str(tls.key),
                             "verify": True, "timeout": 2}
        return json.dumps(config, indent=1)

    def env(self, role: str) -> dict[str, str]:
        """The HALFMOON_* variables that make a service of ``role`` connect as that role."""
        return {"HALFMOON_NATS_USER": role, "HALFMOON_NATS_PASSWORD": self.passwords[role]}

    def connect_options(self, role: str = ADMIN) -> dict[str, str]:
        """``nats.connect`` keyword arguments for a client acting as ``role`` (tests, taps, tools)."""
        return {"user": role, "password": self.passwords[role], "inbox_prefix": inbox_prefix(role)}


def embedded_server_config(run_dir: Path, namespace: str, port: int) -> tuple[NatsAuth, Path]:
    """For ``halfmoon up``: fresh credentials for a loopback server; (auth, config path), both 0600."""
    auth = NatsAuth.generate(namespace)
    auth.save(run_dir / "nats-credentials.json")
    conf = write_private(run_dir / "nats-server.conf", auth.server_config("127.0.0.1", port, run_dir / "nats"))
    return auth, conf
