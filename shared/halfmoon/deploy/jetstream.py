"""The JetStream resources of a deployment, created once by the operator's NATS user (``admin``) before
the services start: ``halfmoon up`` does it after starting NATS, compose's ``jetstream`` job runs
``halfmoon jetstream``. Services may use their buckets but create none: a role allowed ``STREAM.CREATE``
chooses the new stream's subjects, so it could capture and read every other role's traffic.
"""

from __future__ import annotations

from pathlib import Path

import nats
from nats.aio.client import Client
from nats.js.api import KeyValueConfig

from halfmoon.deploy.nats_auth import NatsAuth
from halfmoon.protocol.permissions import leadership_bucket, rate_limit_bucket
from halfmoon.protocol.subjects import Subjects

RATE_WINDOWS_TTL_S = 120.0  # two one-minute windows: the current one and the one just closed
LEADERSHIP_TTL_S = 3.0  # CacheManagerConfig.leadership_ttl_s's default: a lease lapses this long after its renewal


async def create_buckets(nc: Client, namespace: str, leadership_ttl_s: float = LEADERSHIP_TTL_S) -> None:
    """Create (or confirm, when they exist with this configuration) the key-value buckets of ``namespace``:
    the gateways' rate windows and the cache-manager's leadership lease. On disk, so both survive a NATS
    restart that no one re-runs this for."""
    js = nc.jetstream()
    subjects = Subjects(namespace)
    await js.create_key_value(KeyValueConfig(bucket=rate_limit_bucket(subjects), history=1, ttl=RATE_WINDOWS_TTL_S))
    await js.create_key_value(KeyValueConfig(bucket=leadership_bucket(subjects), history=1, ttl=leadership_ttl_s))


async def create_buckets_as_operator(url: str, credentials: Path, leadership_ttl_s: float) -> None:
    """``halfmoon jetstream``: connect as ``admin`` with the deployment's credentials file and create them."""
    auth = NatsAuth.load(credentials)
    nc = await nats.connect(url, connect_timeout=10, max_reconnect_attempts=30, **auth.connect_options())
    try:
        await create_buckets(nc, auth.namespace, leadership_ttl_s)
    finally:
        await nc.close()
