"""The gateway's door: who is asking (API key), whether their tenant may ask now (rate limits),
and which cache salt their request gets (tenants never share KV)."""

from __future__ import annotations

from collections.abc import Mapping

from halfmoon.core.tenants import KeyRing, Tenant, TenantSalts, bearer_key
from halfmoon.services.gateway.errors import ApiError
from halfmoon.services.gateway.ratelimit import SharedRateLimiter
from halfmoon.telemetry.metrics import METRICS


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", headers={"www-authenticate": "Bearer"})


class Guard:
    """With no key ring every request is anonymous (tenant None) and keeps its own cache_salt."""

    def __init__(self, keys: KeyRing | None, salts: TenantSalts, limiter: SharedRateLimiter | None) -> None:
        self.keys, self.salts, self.limiter = keys, salts, limiter

    def authenticate(self, headers: Mapping[str, str]) -> Tenant | None:
        if self.keys is None:
            return None
        key = bearer_key(headers.get("authorization"))
        if key is None:
            METRICS.auth_rejections.labels("missing_key").inc()
            raise _unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.")
        tenant = self.keys.tenant(key)
        if tenant is None:
            METRICS.auth_rejections.labels("invalid_key").inc()
            raise _unauthorized("Incorrect API key provided.")
        return tenant

    async def admit(self, tenant: Tenant | None, tokens: int) -> None:
        """Charge ``tokens`` to the tenant's shared window, or raise 429 with Retry-After."""
        if tenant is None or not tenant.limited or self.limiter is None:
            return
        verdict = await self.limiter.admit(tenant, tokens)
        if not verdict.admitted:
            METRICS.auth_rejections.labels("rate_limited").inc()
            raise ApiError(429, verdict.reason, code="rate_limit_exceeded", type_="rate_limit_error",
                           retry_after_s=verdict.retry_after_s)

    def cache_salt(self, tenant: Tenant | None, request_salt: str | None) -> str | None:
        return request_salt if tenant is None else self.salts.salt(tenant.name, request_salt)
