"""Real NATS peers for conductor tests: services that only heartbeat a load the test sets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from halfmoon.core.kv_spec import KVSpec
from halfmoon.protocol.registry import Load, Role
from halfmoon.runtime import Service, ServiceConfig, ServiceHost


class LoadReporter(Service[ServiceConfig]):
    """A prefill/decode stand-in: registers and heartbeats ``current_load``; does no work."""

    def __init__(self, config: ServiceConfig, role: Role) -> None:
        self.role = role  # per instance: one class stands in for both roles
        super().__init__(config)
        self.current_load = Load()

    @property
    def address(self) -> str:
        if self.role is Role.PREFILL:
            return self.subjects.prefill_submit_to(self.instance_id)
        return self.subjects.decode_submit(self.instance_id)

    def load(self) -> Load:
        return self.current_load

    async def start(self) -> None:
        return None


def reporter_host(
    url: str, namespace: str, instance_id: str, role: Role, load: Load = Load(), interval_s: float = 0.05
) -> ServiceHost:
    config = ServiceConfig(nats_url=url, namespace=namespace, instance_id=instance_id, heartbeat_interval_s=interval_s)
    svc = LoadReporter(config, role)
    svc.current_load = load
    return ServiceHost(svc)


async def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    """Poll ``condition`` until true or fail after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


# A small model's KV layout, for placement policies that need one adopted
SPEC = KVSpec(model_fingerprint="ab" * 16, block_size=16, dtype="float32", num_layers=4, num_kv_heads=2, head_dim=16)
