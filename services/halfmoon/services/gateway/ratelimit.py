"""Per-tenant requests and tokens per minute, shared by every gateway replica through NATS.

Each tenant's usage in the current one-minute window is one key of a JetStream key-value bucket;
a gateway admits a request by a compare-and-set of that key, so N replicas together admit at
most the limit (never N times it). A request is charged its prompt tokens plus the most it may
generate when it is admitted, as OpenAI estimates usage against TPM.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client as NATS
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from halfmoon.core.tenants import Tenant
from halfmoon.protocol.permissions import rate_limit_bucket
from halfmoon.protocol.subjects import Subjects

WINDOW_S = 60.0
_CAS_ATTEMPTS = 8  # replicas racing for one tenant's key; beyond this the request is told to retry


class Usage(msgspec.Struct, frozen=True, array_like=True):
    requests: int = 0
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    usage: Usage  # the window's usage after admitting (unchanged when refused)
    retry_after_s: float = 0.0
    reason: str = ""


def decide(tenant: Tenant, usage: Usage, tokens: int, now: float) -> Verdict:
    """Admit one request costing ``tokens`` given the window's ``usage`` so far (pure)."""
    retry = max(1.0, math.ceil((math.floor(now / WINDOW_S) + 1) * WINDOW_S - now))
    rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
    if tpm and tokens > tpm:
        return Verdict(False, usage, retry, f"this request needs {tokens} tokens, more than the {tpm} tokens per "
                                            f"minute of tenant '{tenant.name}'; lower max_tokens")
    if rpm and usage.requests + 1 > rpm:
        return Verdict(False, usage, retry, f"tenant '{tenant.name}' is over its {rpm} requests per minute")
    if tpm and usage.tokens + tokens > tpm:
        return Verdict(False, usage, retry, f"tenant '{tenant.name}' is over its {tpm} tokens per minute")
    return Verdict(True, Usage(usage.requests + 1, usage.tokens + tokens))


class SharedRateLimiter:
    """Shell over :func:`decide`: reads, decides and compare-and-sets the tenant's window key."""

    def __init__(self, kv: KeyValue, clock: Callable[[], float]) -> None:
        self._kv = kv
        self._clock = clock

    @classmethod
    async def open(cls, nc: NATS, subjects: Subjects, clock: Callable[[], float]) -> SharedRateLimiter:
        js = nc.jetstream()
        name = rate_limit_bucket(subjects)
        try:
            kv = await js.key_value(name)
        except BucketNotFoundError:
            raise RuntimeError(f"the JetStream bucket {name} does not exist: the deployment creates it before the "
                               "gateways start (halfmoon up does; elsewhere python -m halfmoon.deploy.jetstream, "
                               "as compose's jetstream job)") from None
        return cls(kv, clock)

    async def admit(self, tenant: Tenant, tokens: int) -> Verdict:
        now = self._clock()
        key = f"{tenant.name}.{int(now // WINDOW_S)}"
        for _ in range(_CAS_ATTEMPTS):
            try:
                entry = await self._kv.get(key)
                usage, revision = msgspec.json.decode(entry.value or b"[]", type=Usage), entry.revision
            except KeyNotFoundError:
                usage, revision = Usage(), None
            verdict = decide(tenant, usage, tokens, now)
            if not verdict.admitted:
                return verdict
            value = msgspec.json.encode(verdict.usage)
            try:
                if revision is None:
                    await self._kv.create(key, value)
                else:
                    await self._kv.update(key, value, last=revision)
            except KeyWrongLastSequenceError:
                continue  # another replica admitted one first: read again
            return verdict
        return Verdict(False, Usage(), 1.0, f"tenant '{tenant.name}' is sending faster than its limit can be counted")
