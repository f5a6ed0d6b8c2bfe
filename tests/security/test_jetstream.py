"""JetStream: no service creates streams. The operator makes the key-value buckets at deploy time; a
role allowed STREAM.CREATE could name every subject as the new stream's and read all traffic back."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol.permissions import gateway_user, leadership_bucket, rate_limit_bucket
from tests.security.test_nats_permissions import SUBJECTS, connect

BUCKETS = {gateway_user("gateway-0"): rate_limit_bucket(SUBJECTS), "cache-manager": leadership_bucket(SUBJECTS)}


class TestNoRoleCreatesStreams:
    @pytest.mark.parametrize("role", sorted(BUCKETS))
    async def test_creating_its_bucket_with_every_subject_is_refused(self, secure_cluster: LocalCluster,
                                                                     role: str) -> None:
        stream = f"KV_{BUCKETS[role]}"
        errors: list[Exception] = []
        attacker = await connect(secure_cluster, role, errors)
        admin = await connect(secure_cluster, "admin")
        capture = json.dumps({"name": stream, "subjects": [f"{SUBJECTS.root}.>"], "storage": "memory"}).encode()
        try:
            with pytest.raises(Exception):  # noqa: B017 - refused by the server: no reply ever comes
                reply = await attacker.request(f"$JS.API.STREAM.CREATE.{stream}", capture, timeout=3)
                raise AssertionError(reply.data.decode())  # JetStream answered: the request got through
            end = time.monotonic() + 10
            while not errors and time.monotonic() < end:
                await asyncio.sleep(0.05)  # the server's -ERR arrives asynchronously
            info = json.loads((await admin.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=5)).data)
        finally:
            await attacker.close()
            await admin.close()
        assert any("permissions violation" in str(e).lower() and "stream.create" in str(e).lower() for e in errors), errors
        # created by the operator before the services started, with its own subjects only
        assert info["config"]["subjects"] == [f"$KV.{BUCKETS[role]}.>"], info
