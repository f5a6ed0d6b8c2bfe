"""Tenants never share KV: a prefix tenant A sent is cached for A, and invisible to B."""

from __future__ import annotations

import random
import time

import httpx

from halfmoon.deploy.local import LocalCluster
from tests.security.conftest import bearer

PREFIX_TOKENS = 80  # five 16-token blocks


def cached_tokens(cluster: LocalCluster, model: str, tenant: str, prompt: list[int], **extra: object) -> int:
    reply = httpx.post(f"{cluster.url}/v1/completions", headers=bearer(tenant), timeout=120,
                       json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def until_cached(cluster: LocalCluster, model: str, tenant: str, prompt: list[int], **extra: object) -> int:
    """Blocks reach the cache after the reply: ask again until they are reused (or give up after a minute)."""
    end = time.monotonic() + 60
    while (got := cached_tokens(cluster, model, tenant, prompt, **extra)) == 0 and time.monotonic() < end:
        pass
    return got


class TestTenantCacheIsolation:
    def test_a_prefix_is_cached_for_its_tenant_only(self, secure_cluster: LocalCluster, served_model: str) -> None:
        prompt = [random.Random(7).randrange(3, 2000) for _ in range(PREFIX_TOKENS)]
        assert cached_tokens(secure_cluster, served_model, "tenant-a", prompt) == 0
        assert until_cached(secure_cluster, served_model, "tenant-a", prompt) > 0
        assert cached_tokens(secure_cluster, served_model, "tenant-b", prompt) == 0
        assert cached_tokens(secure_cluster, served_model, "tenant-a", prompt) > 0

    def test_a_request_salt_narrows_within_the_tenant(self, secure_cluster: LocalCluster, served_model: str) -> None:
        prompt = [random.Random(8).randrange(3, 2000) for _ in range(PREFIX_TOKENS)]
        cached_tokens(secure_cluster, served_model, "tenant-a", prompt)
        assert until_cached(secure_cluster, served_model, "tenant-a", prompt) > 0
        assert cached_tokens(secure_cluster, served_model, "tenant-a", prompt, cache_salt="project-x") == 0
        assert until_cached(secure_cluster, served_model, "tenant-a", prompt, cache_salt="project-x") > 0
        # B naming A's salt is still B: the salt is combined with the tenant, never a way into another's cache
        assert cached_tokens(secure_cluster, served_model, "tenant-b", prompt, cache_salt="project-x") == 0
