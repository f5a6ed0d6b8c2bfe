"""NATS users for a deployment: one per service role with the subject permissions of
``halfmoon.protocol.permissions``, one per gateway instance (its id is fixed when the users are
made: a gateway runs as one of those ids), plus the operator (``admin``); the nats-server config
that enforces them, and the environment that hands each service its own credentials.

Files are written with mode 0600: whoever can read them can act as any role.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from halfmoon.protocol.permissions import (
    ADMIN,
    KV_CLIENT,
    PLANNER,
    gateway_of_user,
    gateway_user,
    inbox_prefix,
    user_permissions,
)
from halfmoon.protocol.registry import Role
from halfmoon.protocol.subjects import Subjects

ROLES: tuple[str, ...] = (*(r.value for r in Role), KV_CLIENT, PLANNER, ADMIN)
ROLE_USERS = tuple(r for r in ROLES if r != Role.GATEWAY.value)  # gateways have a user per instance


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
    passwords: dict[str, str]  # NATS user (a role, admin, or a gateway_user) -> password

    @classmethod
    def generate(cls, namespace: str, gateways: Iterable[str]) -> NatsAuth:
        """Users for every role but the gateway, and one for each of the gateway instance ids ``gateways``."""
        users = (*ROLE_USERS, *(gateway_user(g) for g in gateways))
        return cls(namespace, {user: secrets.token_urlsafe(24) for user in users})

    @property
    def gateways(self) -> list[str]:
        """The gateway instance ids that have users."""
        return [g for user in self.passwords if (g := gateway_of_user(user)) is not None]

    @classmethod
    def load(cls, path: Path) -> NatsAuth:
        data = json.loads(path.read_text())
        return cls(data["namespace"], data["passwords"])

    def save(self, path: Path) -> Path:
        return write_private(path, json.dumps({"namespace": self.namespace, "passwords": self.passwords}, indent=1))

    def user(self, user: str) -> dict:
        perms = user_permissions(Subjects(self.namespace), user)
        return {"user": user, "password": self.password(user), "permissions": {
            # NOTE: an empty allow-list is no restriction to nats-server; a user that publishes nothing is denied all
            "publish": {"allow": list(perms.publish)} if perms.publish else {"deny": [">"]},
            "subscribe": {"allow": list(perms.subscribe)},
            **({"allow_responses": True} if perms.responds else {}),
        }}

    def authorization(self) -> dict:
        """The ``authorization`` block alone: what a server with its own config includes (Kubernetes)."""
        return {"authorization": {"users": [self.user(u) for u in self.passwords]}}

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

    def password(self, user: str) -> str:
        if user not in self.passwords:
            gateway = gateway_of_user(user)
            raise ValueError(f"these NATS credentials have no user {user!r}" + (
                f": gateway {gateway!r} is not one of the gateways they were made for ({', '.join(self.gateways)})"
                if gateway is not None else ""))
        return self.passwords[user]

    def env(self, user: str) -> dict[str, str]:
        """The HALFMOON_* variables that make a service connect as ``user`` (a role's, or a gateway's: with
        that gateway's instance id, which its user is scoped to)."""
        gateway = gateway_of_user(user)
        return {"HALFMOON_NATS_USER": user, "HALFMOON_NATS_PASSWORD": self.password(user),
                **({"HALFMOON_INSTANCE_ID": gateway} if gateway is not None else {})}

    def connect_options(self, user: str = ADMIN) -> dict[str, str]:
        """``nats.connect`` keyword arguments for a client acting as ``user`` (tests, taps, tools)."""
        return {"user": user, "password": self.password(user), "inbox_prefix": inbox_prefix(user)}


def embedded_server_config(run_dir: Path, namespace: str, port: int,
                           gateways: Iterable[str]) -> tuple[NatsAuth, Path]:
    """For ``halfmoon up``: fresh credentials for a loopback server, with users for the gateway instance ids
    ``gateways``; (auth, config path), both 0600."""
    auth = NatsAuth.generate(namespace, gateways)
    auth.save(run_dir / "nats-credentials.json")
    conf = write_private(run_dir / "nats-server.conf", auth.server_config("127.0.0.1", port, run_dir / "nats"))
    return auth, conf
