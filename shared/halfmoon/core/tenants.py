"""API keys: who a request is (its tenant), and the cache salt that keeps tenants' KV apart.

The keys file has one key per line, ``KEY TENANT [RPM] [TPM]``; ``#`` starts a comment. KEY is
either the key itself or ``sha256:<64 hex digits>`` (its SHA-256), so the file need not hold any
key in the clear. RPM/TPM are that key's tenant's requests and tokens per minute (0 or absent:
unlimited); keys of one tenant must agree on them. Only SHA-256 digests are kept in memory.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    requests_per_minute: int = 0
    tokens_per_minute: int = 0

    @property
    def limited(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute)


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _parse_line(line: str, where: str) -> tuple[bytes, Tenant]:
    fields = line.split()
    if not 2 <= len(fields) <= 4:
        raise ValueError(f"{where}: expected 'KEY TENANT [RPM] [TPM]', got {len(fields)} fields")
    key, name, *limits = fields
    if not _TENANT.match(name):
        raise ValueError(f"{where}: tenant {name!r} must match [A-Za-z0-9_.-]{{1,64}}")
    digest = bytes.fromhex(m.group(1)) if (m := _DIGEST.match(key)) else key_digest(key)
    if not m and len(key) < 16:
        raise ValueError(f"{where}: a key needs at least 16 characters")
    try:
        numbers = [int(x) for x in limits]
    except ValueError:
        raise ValueError(f"{where}: RPM and TPM must be integers, got {limits}") from None
    if any(n < 0 for n in numbers):
        raise ValueError(f"{where}: RPM and TPM must be >= 0")
    return digest, Tenant(name, *numbers)


class KeyRing:
    """Maps presented keys to tenants by SHA-256 digest."""

    def __init__(self, entries: dict[bytes, Tenant]) -> None:
        self._by_digest = entries

    @classmethod
    def parse(cls, text: str, source: str = "api keys") -> KeyRing:
        entries: dict[bytes, Tenant] = {}
        tenants: dict[str, Tenant] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            where = f"{source}:{number}"
            digest, tenant = _parse_line(line, where)
            if digest in entries:
                raise ValueError(f"{where}: duplicate key")
            if tenants.setdefault(tenant.name, tenant) != tenant:
                raise ValueError(f"{where}: tenant {tenant.name!r} has different limits on another line")
            entries[digest] = tenant
        if not entries:
            raise ValueError(f"{source}: no keys")
        return cls(entries)

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        return cls.parse(Path(path).read_text(), str(path))

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def limited(self) -> bool:
        """Whether any tenant has a rate limit (only then does the gateway need the shared counters)."""
        return any(t.limited for t in self._by_digest.values())

    def tenant(self, presented: str) -> Tenant | None:
        """The tenant of ``presented``, or None: every stored digest is compared in constant time,
        with no early exit, so the time taken says nothing about which key came close."""
        digest = key_digest(presented)
        found = None
        for stored, tenant in self._by_digest.items():
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header, or None when absent or malformed."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


class TenantSalts:
    """Each tenant's cache salt: an HMAC of its name under the deployment secret, so tenants never
    share KV blocks and nobody without the secret can compute a tenant's block keys."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def salt(self, tenant: str, request_salt: str | None) -> str:
        base = hmac.new(self._secret, b"halfmoon-tenant/1\x00" + tenant.encode(), hashlib.sha256).hexdigest()
        return within_tenant(base, request_salt)


def within_tenant(tenant_salt: str, request_salt: str | None) -> str:
    """A request's cache salt under its tenant's: a request's own salt narrows within its tenant; it can
    never reach another tenant's salt."""
    return tenant_salt if request_salt is None else f"{tenant_salt}/{request_salt}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable only from this machine (an API without keys may listen there alone)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
