"""The JetStream resources of a deployment, created once by the operator's NATS user (``admin``) before
the services start: ``halfmoon up`` does it after starting NATS, compose's ``jetstream`` job runs this
module. Services may use their buckets but create none: a role allowed ``STREAM.CREATE`` chooses the new
stream's subjects, so it could capture and read every other role's traffic.

``python -m halfmoon.deploy.jetstream --url URL --credentials nats-credentials.json`` (idempotent).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import nats
from halfmoon.deploy.nats_auth import NatsAuth
from halfmoon.protocol.permissions import leadership_bucket, rate_limit_bucket
from halfmoon.protocol.subjects import Subjects
from nats.aio.client import Client
from nats.js.api import KeyValueConfig

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


async def _main(url: str, credentials: Path, leadership_ttl_s: float) -> None:
    auth = NatsAuth.load(credentials)
    nc = await nats.connect(url, connect_timeout=10, max_reconnect_attempts=30, **auth.connect_options())
    try:
        await create_buckets(nc, auth.namespace, leadership_ttl_s)
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m halfmoon.deploy.jetstream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the NATS server")
    parser.add_argument("--credentials", required=True, type=Path, help="nats-credentials.json (halfmoon secrets)")
    parser.add_argument("--leadership-ttl-s", type=float, default=LEADERSHIP_TTL_S,
                        help="the cache-managers' leadership_ttl_s (every one must run with this value)")
    args = parser.parse_args()
    asyncio.run(_main(args.url, args.credentials, args.leadership_ttl_s))


if __name__ == "__main__":
    main()
