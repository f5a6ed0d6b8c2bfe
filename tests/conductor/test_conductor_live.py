"""The conductor against a real NATS server and real heartbeating peers."""

from __future__ import annotations

import asyncio
import signal
import time

import msgspec
import pytest
from fake_instances import SPEC, LoadReporter, reporter_host, wait_until

from halfmoon.core.kv_spec import KVSpec
from halfmoon.protocol import (
    CancelRequest,
    ErrorCode,
    InstanceDown,
    Load,
    RejectReason,
    RemoteError,
    Role,
    SamplingParams,
    ScheduleAccepted,
    ScheduleRejected,
    ScheduleRequest,
    Subjects,
    codecs,
)
from halfmoon.protocol.registry import Leaving, StepSample
from halfmoon.protocol.scheduling import Readiness, ReadinessRequest, Rejected
from halfmoon.protocol.work import WorkDone, WorkOutcome
from halfmoon.runtime import ServiceConfig, ServiceHost, request
from halfmoon.services.conductor.service import ConductorConfig, ConductorService
from halfmoon.telemetry.metrics import METRICS


def schedule_request(rid: str = "r1", deadline_in: float = 30.0) -> ScheduleRequest:
    return ScheduleRequest(
        request_id=rid,
        model="tiny",
        prompt_len=5,
        prompt_token_ids=(1, 2, 3, 4, 5),
        sampling=SamplingParams(max_tokens=4),
        deadline=time.time() + deadline_in,
    )


@pytest.fixture
async def conductor(nats_server, namespace):
    config = ConductorConfig(
        nats_url=nats_server.url,
        namespace=namespace,
        instance_id="conductor-0",
        heartbeat_interval_s=0.1,
        instance_timeout_s=0.4,
        sweep_interval_s=0.05,
        warmup_s=0.2,
    )
    svc = ConductorService(config)
    async with ServiceHost(svc):
        yield svc


async def schedule(nc, namespace, req=None):
    return await request(nc, Subjects(namespace).schedule, req or schedule_request(), codecs.SCHEDULE_REPLY, timeout=5)


async def first_answer(nc, namespace, deadline_s: float = 5.0):
    """The conductor's first reply. A request that reached no conductor (NATS answered "no responders";
    seen once in CI right after start() returned, cause unknown) was neither placed nor rejected: send again."""
    give_up = time.monotonic() + deadline_s
    while True:
        try:
            return await schedule(nc, namespace)
        except RemoteError as exc:
            if exc.code is not ErrorCode.UNAVAILABLE or time.monotonic() > give_up:
                raise
        await asyncio.sleep(0.05)


class DownCollector:
    def __init__(self) -> None:
        self.events: list[InstanceDown] = []

    async def subscribe(self, nc, namespace):
        async def on_msg(msg):
            self.events.append(codecs.DOWN.decode(msg.data))

        await nc.subscribe(Subjects(namespace).down, cb=on_msg)
        await nc.flush()
        return self


class TestChoosesLeastLoaded:
    async def test_least_loaded_prefill_and_decode(self, conductor, nats_server, namespace, nc):
        hosts = [
            reporter_host(nats_server.url, namespace, "p-busy", Role.PREFILL, Load(queue_len=7)),
            reporter_host(nats_server.url, namespace, "p-idle", Role.PREFILL, Load(queue_len=0, running=1)),
            reporter_host(nats_server.url, namespace, "d-busy", Role.DECODE, Load(running=30, free_kv_blocks=10)),
            reporter_host(nats_server.url, namespace, "d-idle", Role.DECODE, Load(running=2, free_kv_blocks=10)),
        ]
        for host in hosts:
            await host.start()
        try:
            await wait_until(
                lambda: (
                    len(conductor.table.candidates(Role.DECODE)) == 2
                    and len(conductor.table.candidates(Role.PREFILL)) == 2
                ),
                what="4 instances registered",
            )
            reply = await schedule(nc, namespace)
            assert isinstance(reply, ScheduleAccepted)
            assert (reply.prefill_instance, reply.decode_instance) == ("p-idle", "d-idle")
            # the load flips: the conductor follows the next heartbeats
            hosts[0].service.current_load = Load()
            hosts[1].service.current_load = Load(queue_len=9)
            await wait_until(lambda: conductor.table.get("p-idle").load.queue_len == 9, what="new load seen")
            assert (await schedule(nc, namespace, schedule_request("r2"))).prefill_instance == "p-busy"
        finally:
            for host in hosts:
                await host.stop()


class TestRequestsLeavingTheBatch:
    async def test_a_request_reported_done_leaves_its_instances_batch_before_the_next_heartbeat(
        self, conductor, nats_server, namespace, nc
    ):
        # heartbeats 30 s apart: only WorkDone can tell the conductor the batch shrank
        hosts = [reporter_host(nats_server.url, namespace, "p0", Role.PREFILL, Load(), interval_s=30.0),
                 reporter_host(nats_server.url, namespace, "d0", Role.DECODE, Load(running=3, free_kv_blocks=10),
                               interval_s=30.0)]
        for host in hosts:
            await host.start()
        try:
            await wait_until(lambda: len(conductor.table.candidates(Role.DECODE)) == 1
                             and len(conductor.table.candidates(Role.PREFILL)) == 1, what="2 instances registered")
            assert isinstance(await schedule(nc, namespace), ScheduleAccepted)
            for instance in ("p0", "d0", "d0"):  # the hand-off, the end of decoding, and a repeat that changes nothing
                done = WorkDone(request_id="r1", instance_id=instance, outcome=WorkOutcome.COMPLETED)
                await nc.publish(Subjects(namespace).work_done_from("decode"), codecs.WORK_DONE.encode(done))
            await wait_until(lambda: conductor.table.get("d0").running == 2, what="d0's batch one smaller")
            assert conductor.table.get("p0").left == 1 and conductor.table.get("d0").left == 1
        finally:
            for host in hosts:
                await host.stop()


class TestLearnsDecodeSteps:
    """The decode cost model learns the steps decoding instances report: one model for both kinds of step
    learns their mean as the sequences saw it (weighted by step counts); with prefill interference, two."""

    LOAD = Load(running=2, total_kv_blocks=10, free_kv_blocks=4,
                steps=StepSample(steps=9, batch=2.0, kv_tokens=100.0, seconds=0.05),
                shared_steps=StepSample(steps=1, batch=2.0, kv_tokens=100.0, seconds=1.05))

    @pytest.mark.parametrize("interference", [False, True])
    async def test_reported_steps_set_the_predicted_step(self, nats_server, namespace, interference):
        config = ConductorConfig(nats_url=nats_server.url, namespace=namespace, instance_id="conductor-0",
                                 heartbeat_interval_s=0.1, warmup_s=0.0, prefill_interference=interference)
        svc = ConductorService(config)
        decode = reporter_host(nats_server.url, namespace, "d0", Role.DECODE, self.LOAD)
        async with ServiceHost(svc):
            await decode.start()
            try:
                decode_cost, shared_cost = svc.decode_cost, svc.shared_cost
                assert decode_cost is not None and (shared_cost is not None) == interference
                # the prior (about 11 ms) is rescaled to what the heartbeats say from the third one on
                if interference:
                    await wait_until(lambda: shared_cost.predict(2, 100) > 0.5, what="the shared steps learned")
                    assert decode_cost.predict(2, 100) == pytest.approx(0.05)
                    assert shared_cost.predict(2, 100) == pytest.approx(1.05)
                else:  # 9 steps of 50 ms and one of 1.05 s: 150 ms between tokens on average
                    await wait_until(lambda: decode_cost.predict(2, 100) > 0.1, what="the steps learned")
                    assert decode_cost.predict(2, 100) == pytest.approx(0.15)
            finally:
                await decode.stop()


class TestStartsAmongLiveInstances:
    async def test_first_request_after_start_is_placed(self, nats_server, namespace, nc):
        """A conductor (re)started into a running deployment takes requests only once it has heard
        every instance beat: the first one it answers is placed, not rejected for want of instances."""
        hosts = [reporter_host(nats_server.url, namespace, iid, role, interval_s=0.2)
                 for iid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE))]
        for host in hosts:
            await host.start()
        config = ConductorConfig(nats_url=nats_server.url, namespace=namespace, instance_id="conductor-late",
                                 heartbeat_interval_s=0.1, warmup_s=1.0)
        try:
            async with ServiceHost(ConductorService(config)):
                reply = await first_answer(nc, namespace)
            assert isinstance(reply, ScheduleAccepted), reply
        finally:
            for host in hosts:
                await host.stop()


class TestRejectsWithoutInstances:
    async def test_no_instances_at_all(self, conductor, nc, namespace):
        reply = await schedule(nc, namespace)
        assert isinstance(reply, ScheduleRejected)
        assert reply.reason is RejectReason.NO_PREFILL_INSTANCE and reply.retry_after_s > 0

    async def test_prefill_but_no_decode(self, conductor, nats_server, namespace, nc):
        async with reporter_host(nats_server.url, namespace, "p0", Role.PREFILL):
            await wait_until(lambda: "p0" in conductor.table, what="p0 registered")
            reply = await schedule(nc, namespace)
        assert isinstance(reply, ScheduleRejected) and reply.reason is RejectReason.NO_DECODE_INSTANCE

    async def test_deadline_already_passed(self, conductor, nc, namespace):
        reply = await schedule(nc, namespace, schedule_request(deadline_in=-1))
        assert isinstance(reply, ScheduleRejected) and reply.reason is RejectReason.DEADLINE


class TestNotesRejections:
    async def test_each_rejected_request_is_noted_for_the_planner_and_a_readiness_probe_is_not(
            self, conductor, nc, namespace):
        notes: list[Rejected] = []

        async def on_note(msg):
            notes.append(codecs.REJECTED.decode(msg.data))

        subjects = Subjects(namespace)
        await nc.subscribe(subjects.rejected, cb=on_note)
        await nc.flush()
        probe = await request(nc, subjects.schedule, ReadinessRequest(), codecs.READINESS_REPLY, timeout=5)
        assert isinstance(probe, Readiness) and not probe.ready
        for req in (schedule_request("r-none"), schedule_request("r-late", deadline_in=-1)):
            assert isinstance(await schedule(nc, namespace, req), ScheduleRejected)
        await wait_until(lambda: len(notes) >= 2, what="two rejection notes")
        assert notes == [  # in order: a note the probe had sent would have come first
            Rejected(conductor="conductor-0", request_id="r-none", reason=RejectReason.NO_PREFILL_INSTANCE,
                     prompt_tokens=5, max_tokens=4),
            Rejected(conductor="conductor-0", request_id="r-late", reason=RejectReason.DEADLINE,
                     prompt_tokens=5, max_tokens=4)]


class TestDropsSilentInstances:
    async def test_crashed_instance_is_dropped_and_announced(self, conductor, nats_server, namespace, nc):
        downs = await DownCollector().subscribe(nc, namespace)
        survivor = reporter_host(nats_server.url, namespace, "p-ok", Role.PREFILL, Load(queue_len=5))
        victim = reporter_host(nats_server.url, namespace, "p-crash", Role.PREFILL)
        decode = reporter_host(nats_server.url, namespace, "d0", Role.DECODE)
        for host in (survivor, victim, decode):
            await host.start()
        try:
            await wait_until(lambda: all(i in conductor.table for i in ("p-ok", "p-crash", "d0")), what="registration")
            assert (await schedule(nc, namespace)).prefill_instance == "p-crash"
            # crash: heartbeats stop and the connection vanishes without a goodbye
            victim._beats.cancel()
            await victim.service.nc.close()
            await wait_until(
                lambda: any(d.instance_id == "p-crash" for d in downs.events),
                timeout_s=5,
                what="InstanceDown for p-crash",
            )
            down = next(d for d in downs.events if d.instance_id == "p-crash")
            assert down.reason == "silent" and down.role is Role.PREFILL
            assert "p-crash" not in conductor.table
            assert (await schedule(nc, namespace, schedule_request("r2"))).prefill_instance == "p-ok"
        finally:
            await survivor.stop()
            await decode.stop()

    async def test_graceful_shutdown_removes_at_once(self, conductor, nats_server, namespace, nc):
        downs = await DownCollector().subscribe(nc, namespace)
        host = reporter_host(nats_server.url, namespace, "d0", Role.DECODE, interval_s=5.0)
        await host.start()
        await wait_until(lambda: "d0" in conductor.table, what="d0 registered")
        await host.stop()
        # heartbeat interval 5 s means expiry would take 15 s: this must come from the goodbye
        await wait_until(lambda: "d0" not in conductor.table, timeout_s=2, what="d0 removed")
        assert [(d.instance_id, d.reason) for d in downs.events] == [("d0", "shutdown")]

    async def test_draining_instance_gets_no_new_work(self, conductor, nats_server, namespace, nc):
        async with (
            reporter_host(nats_server.url, namespace, "p0", Role.PREFILL),
            reporter_host(nats_server.url, namespace, "d0", Role.DECODE) as d0,
        ):
            await wait_until(lambda: len(conductor.table.candidates(Role.DECODE)) == 1, what="d0 registered")
            d0.service.draining = True
            await wait_until(lambda: not conductor.table.candidates(Role.DECODE), what="draining seen")
            reply = await schedule(nc, namespace)
            assert isinstance(reply, ScheduleRejected) and reply.reason is RejectReason.NO_DECODE_INSTANCE


class TestBadScheduleMessages:
    async def test_garbage_gets_typed_error_and_service_goes_on(self, conductor, nc, namespace):
        subject = Subjects(namespace).schedule
        reply = codecs.SCHEDULE_REPLY.decode((await nc.request(subject, b"\x00garbage", timeout=5)).data)
        assert reply.code is ErrorCode.MALFORMED
        wrong = codecs.CANCEL.encode(CancelRequest(request_id="x"))
        reply = codecs.SCHEDULE_REPLY.decode((await nc.request(subject, wrong, timeout=5)).data)
        assert reply.code is ErrorCode.UNKNOWN_KIND
        raw = msgspec.msgpack.decode(codecs.SCHEDULE_REQUEST.encode(schedule_request()))
        raw["v"] = 99
        reply = codecs.SCHEDULE_REPLY.decode((await nc.request(subject, msgspec.msgpack.encode(raw), timeout=5)).data)
        assert reply.code is ErrorCode.UNSUPPORTED_VERSION
        assert isinstance(await schedule(nc, namespace), ScheduleRejected)  # still serving

    async def test_no_conductor_is_a_typed_unavailable(self, nc, namespace):
        with pytest.raises(RemoteError) as info:
            await schedule(nc, namespace)
        assert info.value.code is ErrorCode.UNAVAILABLE


class TestConductorProcess:
    async def test_sigterm_drains_says_goodbye_and_exits_zero(self, nats_server, namespace, nc, processes):
        beats: list = []
        downs = await DownCollector().subscribe(nc, namespace)

        async def on_beat(msg):
            beats.append(codecs.HEARTBEAT.decode(msg.data))

        await nc.subscribe(Subjects(namespace).heartbeat, cb=on_beat)
        await nc.flush()
        proc = processes.start(
            [
                "-m",
                "halfmoon.services.conductor",
                "--nats-url",
                nats_server.url,
                "--namespace",
                namespace,
                "--instance-id",
                "cond-1",
                "--heartbeat-interval-s",
                "0.1",
            ]
        )
        await wait_until(
            lambda: any(b.instance_id == "cond-1" for b in beats), timeout_s=30, what="conductor heartbeat"
        )
        assert beats[0].role is Role.CONDUCTOR
        assert isinstance(await schedule(nc, namespace), ScheduleRejected)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
        assert [(d.instance_id, d.reason) for d in downs.events] == [("cond-1", "shutdown")]
        assert any(b.leaving is Leaving.DRAINING for b in beats if b.instance_id == "cond-1")


class TestPacesLongPrompts:
    """An aggregated instance whose engine paces prompts takes a long prompt beside its decoding sequences
    paced, over real NATS: the reply names the step target and the conductor counts it; one that does not
    pace turns the same request away."""

    # eight sequences decoding at 66 ms a step
    LOAD = Load(running=8, total_kv_blocks=1000, free_kv_blocks=900,
                window_steps=StepSample(steps=60, batch=8.0, kv_tokens=1600.0, seconds=0.066))

    class Aggregated(LoadReporter):
        def __init__(self, config: ServiceConfig, paces: bool) -> None:
            super().__init__(config, Role.AGGREGATED)
            self.paces = paces

        @property
        def address(self) -> str:
            return self.subjects.prefill_submit_to(self.instance_id)

        @property
        def kv_spec(self) -> KVSpec | None:
            return SPEC

        @property
        def paces_prompts(self) -> bool:
            return self.paces

    @pytest.mark.parametrize("paces", [True, False])
    async def test_a_long_prompt_beside_decoding_sequences(self, nats_server, namespace, nc, paces):
        config = ConductorConfig(nats_url=nats_server.url, namespace=namespace, instance_id="conductor-0",
                                 heartbeat_interval_s=0.1, warmup_s=0.0)
        aggregated = self.Aggregated(ServiceConfig(nats_url=nats_server.url, namespace=namespace,
                                                   instance_id="a0", heartbeat_interval_s=0.05), paces)
        aggregated.current_load = self.LOAD
        # 2,725 tokens at the conductor's prior of 0.125 ms each: 0.34 s of prefill over the 2 tokens asked for
        # puts the decoders at 0.066 + 0.17 s, past the 0.2 s SLO; paced, 0.34 x 0.15 / (0.15 - 0.066) s
        prompt = tuple(range(3, 2_728))
        req = ScheduleRequest(request_id="long", model="tiny", prompt_len=len(prompt), prompt_token_ids=prompt,
                              sampling=SamplingParams(max_tokens=2), deadline=time.time() + 30)
        paced_before = METRICS.paced_placements._value.get()
        svc = ConductorService(config)
        async with ServiceHost(svc), ServiceHost(aggregated):
            await wait_until(lambda: getattr(svc.policy, "spec", None) is not None and bool(svc.table.candidates(Role.AGGREGATED)),
                             what="the aggregated instance and its KV spec")
            reply = await request(nc, Subjects(namespace).schedule, req, codecs.SCHEDULE_REPLY, timeout=5)
        if paces:
            assert isinstance(reply, ScheduleAccepted), reply
            assert reply.prefill_instance == reply.decode_instance == "a0"
            assert reply.step_target_s == pytest.approx(0.75 * 0.2)
            assert reply.predicted_ttft_ms == pytest.approx(2_725 / 8_000 * 0.15 / (0.15 - 0.066) * 1000, rel=0.05)
            assert METRICS.paced_placements._value.get() == paced_before + 1
        else:
            assert isinstance(reply, ScheduleRejected) and reply.reason is RejectReason.OVERLOADED, reply
            assert METRICS.paced_placements._value.get() == paced_before
