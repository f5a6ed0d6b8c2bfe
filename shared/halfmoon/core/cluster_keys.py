"""The cluster secret and the keys derived from it, one per purpose.

Every data-plane check is keyed by one secret shared by the services of a deployment
(``HALFMOON_CLUSTER_SECRET`` or ``HALFMOON_CLUSTER_SECRET_FILE``): the transfer handshake,
the capabilities the cache-manager grants, the park capabilities workers mint for their own
hand-off blocks, and the KV block MAC. Each use gets its own derived key, so a key leaked
from one use (e.g. a block MAC key in a core dump of an engine) does not sign anything else.

Without a secret the keys derive from a fixed, public development secret: unit tests and
benchmarks run unchanged, and every service logs that it is insecure (``insecure``).
"""

from __future__ import annotations

import hmac
import os
from typing import NamedTuple

DEV_SECRET = b"halfmoon-insecure-development-secret"  # public: anyone can authenticate with it
MIN_SECRET_BYTES = 16


def derive(secret: bytes, purpose: str) -> bytes:
    return hmac.digest(secret, b"halfmoon/" + purpose.encode(), "sha256")


class ClusterKeys(NamedTuple):
    handshake: bytes  # transfer connection challenge-response, both ways
    grant: bytes  # capabilities the cache-manager signs
    park: bytes  # capabilities a worker signs for its own one-off hand-off keys
    kv_mac: bytes  # the MAC of every KV block payload
    insecure: bool  # derived from DEV_SECRET

    @classmethod
    def from_secret(cls, secret: bytes | None) -> ClusterKeys:
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
        root = secret if secret is not None else DEV_SECRET
        return cls(derive(root, "handshake"), derive(root, "grant"), derive(root, "park"), derive(root, "kv-mac"),
                   secret is None)

    def __repr__(self) -> str:  # NOTE: never print key material (configs and layouts get logged)
        return f"ClusterKeys(insecure={self.insecure})"


DEV_KEYS = ClusterKeys.from_secret(None)


def load_secret(value: str = "", path: str = "") -> bytes | None:
    """The secret from its value or a file holding it (trailing newline dropped); None when neither is set."""
    if value and path:
        raise ValueError("set the cluster secret or its file, not both")
    if path:
        with open(path, "rb") as f:
            return f.read().rstrip(b"\r\n")
    return value.encode() if value else None


def new_secret() -> str:
    """A fresh random secret (what ``halfmoon up`` hands every service of one run)."""
    return os.urandom(32).hex()
