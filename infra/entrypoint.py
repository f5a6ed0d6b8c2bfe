#!/usr/bin/env python3
"""Container entrypoint: the per-replica settings a compose file cannot express, then ``exec`` the command.

- A transfer node listening on a wildcard address (``HALFMOON_HOST=0.0.0.0``) with no
  ``HALFMOON_ADVERTISE_HOST`` advertises this container's own IP, so every scaled replica
  announces an address its peers can reach.
- ``HALFMOON_NVME_ROOT``: replicas share one named volume; each claims the first free
  ``slot-N`` directory under it by an exclusive ``flock`` on ``slot-N.lock`` and runs with
  ``HALFMOON_NVME_DIR`` set to it. The locked descriptor is inherited across ``exec``, so the
  slot stays claimed exactly as long as the service process lives, and a restarted replica
  takes a free slot back (with the blocks it holds) instead of leaving an orphan directory.
- ``HALFMOON_SECRETS_DIR``: the directory ``halfmoon secrets`` wrote (compose's ``secrets`` volume).
  The service connects to NATS as its own role (``HALFMOON_SECRETS_ROLE``, else the role the command
  names: ``python -m halfmoon.services.cache_manager`` is ``cache-manager``), keys its data plane
  with the cluster secret, and a gateway checks the API keys there, a transfer node uses the S3
  keys there. A variable already set to a non-empty value is left alone.
- Gateways: each has a NATS user of its own, scoped to one instance id (``halfmoon secrets --gateways N``
  writes ``gateway-0.env`` .. ``gateway-<N-1>.env``). A replica runs as gateway slot
  ``HALFMOON_GATEWAY_SLOT`` (Kubernetes: the pod's index), else claims the lowest free one by ``flock``
  under ``HALFMOON_GATEWAY_SLOTS``, a writable directory the replicas share, held as the NVMe slots are;
  it takes that slot's instance id and credentials.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from collections.abc import MutableMapping
from pathlib import Path

WILDCARDS = {"0.0.0.0", "::"}
MAX_SLOTS = 256


class NoFreeSlot(RuntimeError):
    pass


def own_address() -> str:
    """The IPv4 address this container's hostname resolves to (its address on the compose network)."""
    return socket.gethostbyname(socket.gethostname())


def claim_slot(root: Path, limit: int = MAX_SLOTS) -> tuple[int, int]:
    """(number, inheritable locked fd) of the lowest-numbered slot under ``root`` no live process holds."""
    root.mkdir(parents=True, exist_ok=True)
    for n in range(limit):
        fd = os.open(root / f"slot-{n}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.set_inheritable(fd, True)
        return n, fd
    raise NoFreeSlot(f"all {limit} slots under {root} are held by running replicas")


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def role_of(command: list[str]) -> str:
    """The service role a ``python -m halfmoon.services.<name>`` command runs ('' for anything else)."""
    modules = [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == "-m"]
    prefix = "halfmoon.services."
    return next((m[len(prefix):].replace("_", "-") for m in modules if m.startswith(prefix)), "")


def gateway_slot(env: MutableMapping[str, str], secrets: Path) -> str:
    """The name of this gateway replica's slot (``gateway-<n>``: its instance id and its env file's name)."""
    slots = len(list(secrets.glob("gateway-*.env")))
    if chosen := env.get("HALFMOON_GATEWAY_SLOT", ""):
        n = int(chosen)
    elif root := env.get("HALFMOON_GATEWAY_SLOTS", ""):
        try:
            n, _fd = claim_slot(Path(root), slots)  # NOTE: _fd stays open: the lock must outlive this exec
        except NoFreeSlot as exc:
            raise SystemExit(f"{exc}: `halfmoon secrets --gateways N` makes N gateway slots") from None
    else:
        raise SystemExit("a gateway runs as one of the gateway slots `halfmoon secrets` made: set "
                         "HALFMOON_GATEWAY_SLOTS (a writable directory its replicas share) or HALFMOON_GATEWAY_SLOT")
    return f"gateway-{n}"


def load_secrets(env: MutableMapping[str, str], command: list[str]) -> None:
    directory = env.get("HALFMOON_SECRETS_DIR", "")
    if not directory:
        return
    root, role = Path(directory), env.get("HALFMOON_SECRETS_ROLE") or role_of(command)
    name = gateway_slot(env, root) if role == "gateway" else role
    if not (root / f"{name}.env").is_file():
        raise SystemExit(f"HALFMOON_SECRETS_DIR={directory} has no {name or '<HALFMOON_SECRETS_ROLE>'}.env: "
                         "run `halfmoon secrets DIR` (compose's `secrets` job does)")
    found = read_env_file(root / f"{name}.env")
    found["HALFMOON_CLUSTER_SECRET_FILE"] = str(root / "cluster-secret")
    if role == "gateway":
        found.update(HALFMOON_API_KEYS_FILE=str(root / "api-keys"), HALFMOON_AUTH_SECRET_FILE=str(root / "auth-secret"))
    if role == "transfer":
        found.update({k: v for k, v in read_env_file(root / "s3.env").items() if k.startswith("HALFMOON_")})
    for key, value in found.items():
        if not env.get(key):
            env[key] = value


def prepare(env: MutableMapping[str, str], command: list[str]) -> None:
    """Fill in the per-replica variables in ``env`` for ``command`` (see the module docstring)."""
    load_secrets(env, command)
    if env.get("HALFMOON_HOST") in WILDCARDS and not env.get("HALFMOON_ADVERTISE_HOST"):
        env["HALFMOON_ADVERTISE_HOST"] = own_address()
    if root := env.pop("HALFMOON_NVME_ROOT", ""):
        n, _fd = claim_slot(Path(root))  # NOTE: _fd stays open: the lock must outlive this exec
        slot = Path(root) / f"slot-{n}"
        slot.mkdir(exist_ok=True)
        env["HALFMOON_NVME_DIR"] = str(slot)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: halfmoon-entrypoint COMMAND [ARG...]")
    prepare(os.environ, argv)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
