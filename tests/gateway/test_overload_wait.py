"""A request the conductor turns away as overloaded: asked again for ``overload_wait_s``, its wait counted, and
placed once the overload passes; with no wait, the 429 comes at once. A real conductor on real NATS, judging
instances that heartbeat a load the test sets."""

from __future__ import annotations

import asyncio
import time

import pytest

from halfmoon.core.kv_spec import KVSpec
from halfmoon.protocol import Load, Role, SamplingParams, ScheduleAccepted, ScheduleRequest, codecs
from halfmoon.protocol.base import ErrorCode
from halfmoon.runtime import ServiceConfig, ServiceHost
from halfmoon.services.conductor.service import ConductorConfig, ConductorService
from halfmoon.services.gateway.attempts import GenerationError
from halfmoon.services.gateway.peers import schedule
from tests.conductor.fake_instances import SPEC, LoadReporter, wait_until

FULL = Load(free_kv_blocks=0, total_kv_blocks=64)  # no room for any request's KV: every placement is refused
ROOMY = Load(free_kv_blocks=64, total_kv_blocks=64)


class SpecReporter(LoadReporter):
    @property
    def kv_spec(self) -> KVSpec:
        return SPEC


def reporter(url: str, namespace: str, instance_id: str, role: Role, load: Load) -> ServiceHost:
    svc = SpecReporter(ServiceConfig(nats_url=url, namespace=namespace, instance_id=instance_id,
                                     heartbeat_interval_s=0.05), role)
    svc.current_load = load
    return ServiceHost(svc)


def schedule_request(rid: str) -> ScheduleRequest:
    return ScheduleRequest(request_id=rid, model="tiny", prompt_len=40, prompt_token_ids=tuple(range(1, 41)),
                           sampling=SamplingParams(max_tokens=8), deadline=time.time() + 60)


@pytest.fixture
async def overloaded(nats_server, namespace, gateway_factory):
    """A gateway, a conductor, and a prefill and decode instance whose decode has no free KV block."""
    conductor = ConductorService(ConductorConfig(nats_url=nats_server.url, namespace=namespace,
                                                 heartbeat_interval_s=0.1, warmup_s=0.2, retry_after_s=0.2))
    hosts = [reporter(nats_server.url, namespace, "p0", Role.PREFILL, ROOMY),
             reporter(nats_server.url, namespace, "d0", Role.DECODE, FULL)]
    async with ServiceHost(conductor):
        for host in hosts:
            await host.start()
        try:
            await wait_until(lambda: {"p0", "d0"} <= set(conductor.table.ids()) and conductor.policy.spec is not None)
            yield await gateway_factory(), hosts[1].service
        finally:
            for host in reversed(hosts):
                await host.stop()


class TestOverloadWait:
    async def test_without_a_wait_the_rejection_comes_at_once(self, overloaded) -> None:
        gateway, _decode = overloaded
        retries: list[str] = []
        with pytest.raises(GenerationError) as raised:
            await schedule(gateway, schedule_request("now"), time.time() + 60, 5.0, retries.append)
        assert raised.value.code is ErrorCode.OVERLOADED and retries == []

    async def test_an_overload_that_passes_delays_the_request_instead(self, overloaded, nc, namespace) -> None:
        gateway, decode = overloaded
        sent: list[ScheduleRequest] = []

        async def seen(msg) -> None:
            request = codecs.SCHEDULE_REQUEST.decode(msg.data)
            if isinstance(request, ScheduleRequest):
                sent.append(request)

        await nc.subscribe(gateway.subjects.schedule, cb=seen)
        await nc.flush()
        retries: list[str] = []
        placing = asyncio.create_task(schedule(gateway, schedule_request("later"), time.time() + 60, 5.0,
                                               retries.append, overload_wait_s=30.0))
        await wait_until(lambda: len(retries) >= 2, what="the request turned away and asked again")
        assert not placing.done()
        decode.current_load = ROOMY
        accepted = await asyncio.wait_for(placing, 10)
        assert isinstance(accepted, ScheduleAccepted) and accepted.decode_instance == "d0"
        assert all(r.startswith("overloaded") for r in retries)
        waits = [r.waited_s for r in sent]
        assert waits[0] == 0.0 and waits == sorted(waits) and waits[-1] > 0  # each ask says how long it waited

    async def test_the_wait_is_bounded(self, overloaded) -> None:
        gateway, _decode = overloaded
        retries: list[str] = []
        started = time.monotonic()
        with pytest.raises(GenerationError) as raised:
            await schedule(gateway, schedule_request("bounded"), time.time() + 60, 5.0, retries.append,
                           overload_wait_s=2.5)
        assert raised.value.code is ErrorCode.OVERLOADED and retries
        assert 1.0 <= time.monotonic() - started < 2.5 + 2.0  # asked again a second later, and stopped
