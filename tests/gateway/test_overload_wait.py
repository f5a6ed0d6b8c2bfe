"""A request the conductor turns away as overloaded: asked again while the conductor expects the prompt work
queued ahead to drain within ``overload_wait_s``, its wait counted, and placed once it has; an overload that
waiting would not clear is answered at once. A real conductor on real NATS, judging instances that heartbeat
a load the test sets."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from halfmoon.core.kv_spec import KVSpec
from halfmoon.protocol import Load, Role, SamplingParams, ScheduleAccepted, ScheduleRequest, Subjects, codecs
from halfmoon.protocol.base import ErrorCode
from halfmoon.protocol.work import WorkDone, WorkOutcome
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


async def start_conductor(nats_server, namespace, **policy) -> ServiceHost:
    host = ServiceHost(ConductorService(ConductorConfig(nats_url=nats_server.url, namespace=namespace,
                                                        heartbeat_interval_s=0.1, warmup_s=0.2, **policy)))
    await host.start()
    return host


@pytest.fixture
async def full_decode(nats_server, namespace, gateway_factory):
    """A gateway, a conductor, and a prefill and decode instance whose decode has no free KV block: no wait
    would let a request in."""
    conductor = await start_conductor(nats_server, namespace)
    hosts = [reporter(nats_server.url, namespace, "p0", Role.PREFILL, ROOMY),
             reporter(nats_server.url, namespace, "d0", Role.DECODE, FULL)]
    try:
        for host in hosts:
            await host.start()
        svc = conductor.service
        await wait_until(lambda: {"p0", "d0"} <= set(svc.table.ids()) and svc.policy.spec is not None)
        yield await gateway_factory()
    finally:
        for host in reversed(hosts):
            await host.stop()
        await conductor.stop()


@contextlib.asynccontextmanager
async def aggregated_with_a_queue(nats_server, namespace, gateway_factory, **policy):
    """A gateway, a conductor predicting 0.4 s of prefill per 40-token prompt, and one aggregated instance:
    prompts placed there and not yet computed are what its decoding sequences would wait on (the fourth such
    prompt puts them over the 0.2 s TBT SLO, and the conductor expects it to clear as they are computed)."""
    # placed work the heartbeats do not show stays on the ledger for the test's length: only WorkDone drains it
    conductor = await start_conductor(nats_server, namespace, prefill_tokens_per_s=100.0, ledger_grace_s=60.0,
                                      **policy)
    host = reporter(nats_server.url, namespace, "a0", Role.AGGREGATED, ROOMY)
    try:
        await host.start()
        svc = conductor.service
        await wait_until(lambda: "a0" in set(svc.table.ids()) and svc.policy.spec is not None)
        yield await gateway_factory()
    finally:
        await host.stop()
        await conductor.stop()


@pytest.fixture
async def queued(nats_server, namespace, gateway_factory):
    async with aggregated_with_a_queue(nats_server, namespace, gateway_factory) as gateway:
        yield gateway


@pytest.fixture
async def queued_tight_ttft(nats_server, namespace, gateway_factory):
    """The same, with a TTFT SLO of 3 s: about 1 s more than the queued prompts and the request's own take."""
    async with aggregated_with_a_queue(nats_server, namespace, gateway_factory, ttft_slo_s=3.0) as gateway:
        yield gateway


class TestOverloadWait:
    async def test_an_overload_waiting_would_not_clear_is_answered_at_once(self, full_decode) -> None:
        retries: list[str] = []
        started = time.monotonic()
        with pytest.raises(GenerationError) as raised:
            await schedule(full_decode, schedule_request("now"), time.time() + 60, 5.0, retries.append,
                           overload_wait_s=30.0)
        assert raised.value.code is ErrorCode.OVERLOADED and retries == []
        assert time.monotonic() - started < 5.0

    async def test_queued_prompt_work_that_drains_delays_the_request_instead(self, queued, nc, namespace) -> None:
        gateway = queued
        placed: list[str] = []
        with pytest.raises(GenerationError) as raised:  # placements nobody computes pile up until one is refused
            for i in range(20):
                await schedule(gateway, schedule_request(f"r{i}"), time.time() + 60, 5.0, list.append,
                               overload_wait_s=0.0)
                placed.append(f"r{i}")
        assert raised.value.code is ErrorCode.OVERLOADED and "decode_overloaded" in raised.value.message
        assert placed

        sent: list[ScheduleRequest] = []  # every ask of the request, as the gateway sends it
        ask = gateway.request

        async def recorded(subject, message, *args, **kwargs):  # type: ignore[no-untyped-def]
            if isinstance(message, ScheduleRequest) and message.request_id == "later":
                sent.append(message)
            return await ask(subject, message, *args, **kwargs)

        gateway.request = recorded  # type: ignore[method-assign]
        retries: list[str] = []
        placing = asyncio.create_task(schedule(gateway, schedule_request("later"), time.time() + 60, 5.0,
                                               retries.append, overload_wait_s=60.0))
        await wait_until(lambda: len(retries) >= 2, what="the request turned away and asked again")
        assert not placing.done()
        for rid in placed:  # the instance computed the queued prompts
            done = WorkDone(request_id=rid, instance_id="a0", outcome=WorkOutcome.COMPLETED)
            await nc.publish(Subjects(namespace).work_done_from("aggregated"), codecs.WORK_DONE.encode(done))
        accepted = await asyncio.wait_for(placing, 10)
        assert isinstance(accepted, ScheduleAccepted) and accepted.decode_instance == "a0"
        assert all(r.startswith("overloaded") for r in retries)
        waits = [r.waited_s for r in sent]
        assert len(waits) == len(retries) + 1  # the first ask, then one a turn-away
        assert waits[0] == 0.0 and waits == sorted(waits) and waits[-1] > 0  # each ask says how long it waited

    async def test_the_wait_is_bounded(self, queued) -> None:
        await fill_until_refused(queued)
        error, retries, waited = await turned_away(queued, overload_wait_s=2.5)
        assert error.code is ErrorCode.OVERLOADED and retries
        assert 1.0 <= waited < 2.5 + 2.0  # asked again a second later, and stopped

    async def test_the_conductor_s_ttft_slo_ends_the_wait(self, queued_tight_ttft) -> None:
        await fill_until_refused(queued_tight_ttft)
        error, retries, waited = await turned_away(queued_tight_ttft, overload_wait_s=60.0)  # the SLO allows ~1 s
        assert error.code is ErrorCode.OVERLOADED and "ttft_slo" in error.message
        assert retries and all(r.startswith("overloaded") for r in retries)  # it did wait for the queue first
        assert waited < 3.0 + 2.0


async def fill_until_refused(gateway) -> None:
    """Places prompts that nobody computes until the conductor refuses one."""
    with pytest.raises(GenerationError):
        for i in range(20):
            await schedule(gateway, schedule_request(f"r{i}"), time.time() + 60, 5.0, list.append)


async def turned_away(gateway, overload_wait_s: float) -> tuple[GenerationError, list[str], float]:
    """One more request's 429: the error, the retries it made first, and the seconds until it came."""
    retries: list[str] = []
    started = time.monotonic()
    with pytest.raises(GenerationError) as raised:
        await schedule(gateway, schedule_request("late"), time.time() + 60, 5.0, retries.append,
                       overload_wait_s=overload_wait_s)
    return raised.value, retries, time.monotonic() - started
