"""One instance of each kind, attacked from outside: what a deployment with no spare must still get right.

One cluster for the module (1 conductor, 1 prefill, 1 decode): readiness before the first requests, the
only prefill killed while it prefills, a down notice about a run of an instance that is already back, and a
CancelRequest nobody asked for. Each drill restarts what it kills itself, as a supervisor would.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from halfmoon.deploy.drills import (
    Outcome,
    gateway_counter,
    heartbeats,
    operator_nats,
    read_stream,
    restart,
    wait_live,
)
from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol import codecs
from halfmoon.protocol.base import Codec
from halfmoon.protocol.registry import Heartbeat, InstanceDown, Role
from halfmoon.protocol.stream import TokenEvent
from halfmoon.protocol.subjects import Subjects
from halfmoon.protocol.work import CancelRequest
from tests.e2e.conftest import AUTH, model_name, start_cluster

# The next-token timeout is far past the client's patience: only a prompt reaction to a fault mid-stream can
# finish a request in time. A restarted engine takes minutes on a loaded machine: the first token and the wait
# for an instance get that long, and so does the TTFT SLO: these drills are about losing requests, not about
# predicting TTFTs (on a loaded machine 8 long prompts were predicted 32 s and rejected as over a 30 s SLO).
RECOVERY_ENV = {"HALFMOON_SCHEDULE_TIMEOUT_S": "2", "HALFMOON_STALL_PROBE_S": "1", "HALFMOON_ITL_TIMEOUT_S": "400",
                "HALFMOON_TTFT_TIMEOUT_S": "300", "HALFMOON_INSTANCE_WAIT_S": "280", "HALFMOON_TTFT_SLO_S": "900"}
CLIENT_TIMEOUT_S = 320.0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("run-recovery"), env=RECOVERY_ENV,
                            conductor=1, prefill=1, decode=1)
    yield cluster
    cluster.stop()


def long_prompt(words: int, seed: int) -> str:
    """Distinct words per seed, so no request reuses another's prefix and each really prefills."""
    rng = random.Random(seed)
    return " ".join(rng.choice(("moon", "half", "tide", "orbit", "crater", "light", "dust", "phase", "night"))
                    + str(rng.randrange(1000)) for _ in range(words))


async def stream_one(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started = time.monotonic()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Outcome(started, time.monotonic(), "error", f"{response.status_code}: {await response.aread()}")
            return read_stream(started, [line async for line in response.aiter_lines()])
    except httpx.HTTPError as exc:
        return Outcome(started, time.monotonic(), "lost", f"{type(exc).__name__}: {exc}")


def burst(cluster: LocalCluster, prompts: list[str], max_tokens: int,
          while_in_flight: Callable[[], None] = lambda: None) -> list[Outcome]:
    """Stream every prompt at once; ``while_in_flight`` runs (in a thread) as soon as they are sent."""
    model = model_name(cluster)

    async def run() -> list[Outcome]:
        async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH,
                                     timeout=httpx.Timeout(CLIENT_TIMEOUT_S, connect=10)) as http:
            requests = [asyncio.create_task(stream_one(http, model, p, max_tokens)) for p in prompts]
            await asyncio.to_thread(while_in_flight)
            return await asyncio.gather(*requests)

    return asyncio.run(run())


def when_prefill_holds(cluster: LocalCluster, instance_id: str, at_least: int, timeout: float = 60.0) -> Heartbeat:
    """Block until ``instance_id`` heartbeats holding ``at_least`` requests (queued or running); that beat."""
    async def watch() -> Heartbeat:
        nc = await operator_nats(cluster)
        holding: asyncio.Future[Heartbeat] = asyncio.get_running_loop().create_future()
        most = [0]

        async def on_beat(msg) -> None:  # type: ignore[no-untyped-def]
            beat = codecs.HEARTBEAT.decode(msg.data)
            if beat.instance_id != instance_id:
                return
            most[0] = max(most[0], beat.load.queue_len + beat.load.running)
            if most[0] >= at_least and not holding.done():
                holding.set_result(beat)

        try:
            await nc.subscribe(Subjects(cluster.namespace).heartbeat, cb=on_beat)
            return await asyncio.wait_for(holding, timeout)
        except TimeoutError:
            raise AssertionError(f"{instance_id} held at most {most[0]} requests in {timeout}s") from None
        finally:
            await nc.close()

    return asyncio.run(watch())


def publish(cluster: LocalCluster, subject: str, message) -> None:  # type: ignore[no-untyped-def]
    async def send() -> None:
        nc = await operator_nats(cluster)
        await nc.publish(subject, Codec.encode(message))
        await nc.flush()
        await nc.close()

    asyncio.run(send())


def assert_all_served(outcomes: list[Outcome]) -> None:
    failed = [o.detail for o in outcomes if o.status != "ok"]
    assert not failed, f"{len(failed)} of {len(outcomes)} not served: {failed[:3]}"


class TestReadiness:
    def test_requests_sent_right_after_ready_are_all_placed_at_once(self, cluster: LocalCluster) -> None:
        # the fixture's start returned the moment the gateway's /ready first said yes
        waits_before = gateway_counter(cluster, "halfmoon_schedule_retries_total")
        outcomes = burst(cluster, [f"first request {i} of a fresh deployment" for i in range(8)], max_tokens=8)
        assert_all_served(outcomes)
        assert gateway_counter(cluster, "halfmoon_schedule_retries_total") == waits_before  # nobody had to wait
        ready = httpx.get(f"{cluster.url}/ready", timeout=10)
        assert ready.status_code == 200 and ready.json()["prefill"] == 1 and ready.json()["decode"] == 1
        assert httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200


class TestOnlyPrefillKilled:
    def test_requests_it_held_wait_for_its_restart_and_complete(self, cluster: LocalCluster) -> None:
        def kill_while_prefilling() -> None:
            when_prefill_holds(cluster, "prefill-0", at_least=1)
            cluster.kill("prefill-0")
            restart(cluster, "prefill-0")  # the supervisor's part: back in seconds, after its silence is noticed

        migrations = gateway_counter(cluster, "halfmoon_migrations_total")
        try:
            outcomes = burst(cluster, [long_prompt(600, seed) for seed in range(8)], max_tokens=16,
                             while_in_flight=kill_while_prefilling)
        finally:  # the module's later drills need it
            wait_live(cluster, {"prefill-0"}, timeout=300)
        assert_all_served(outcomes)
        # a request the dead instance held moves once, to its restart; waiting for it burns no second move
        assert gateway_counter(cluster, "halfmoon_migrations_total") - migrations <= len(outcomes)


class TestLateDownNotice:
    def test_a_notice_about_the_run_before_a_restart_moves_nothing(self, cluster: LocalCluster) -> None:
        earlier = heartbeats(cluster, 1.0)["prefill-0"].incarnation
        assert earlier
        cluster.kill("prefill-0")
        restart(cluster, "prefill-0")
        wait_live(cluster, {"prefill-0"}, timeout=300)
        assert heartbeats(cluster, 1.0)["prefill-0"].incarnation != earlier
        migrations = gateway_counter(cluster, "halfmoon_migrations_total")

        def late_notice() -> None:
            when_prefill_holds(cluster, "prefill-0", at_least=1)
            late = InstanceDown(instance_id="prefill-0", role=Role.PREFILL, reason="silent", timestamp=time.time(),
                                incarnation=earlier)
            publish(cluster, Subjects(cluster.namespace).down_from(Role.CONDUCTOR.value), late)

        outcomes = burst(cluster, [long_prompt(600, 100 + seed) for seed in range(8)], max_tokens=16,
                         while_in_flight=late_notice)
        assert_all_served(outcomes)
        assert gateway_counter(cluster, "halfmoon_migrations_total") == migrations


class TestForeignCancel:
    def test_a_cancel_the_gateway_did_not_send_migrates_the_request_at_once(self, cluster: LocalCluster) -> None:
        migrations = gateway_counter(cluster, "halfmoon_migrations_total")
        cancelled: dict[str, str] = {}

        async def run() -> Outcome:
            nc = await operator_nats(cluster)
            wanted: dict[str, str] = {}

            async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
                event = codecs.STREAM.decode(msg.data)
                if (isinstance(event, TokenEvent) and event.request_id == wanted.get("id") and event.index >= 8
                        and event.instance_id == "decode-0" and not cancelled):
                    cancelled["by"] = event.instance_id
                    cancel = CancelRequest(request_id=event.request_id, reason="not from its gateway")
                    await nc.publish(Subjects(cluster.namespace).cancel, Codec.encode(cancel))

            await nc.subscribe(Subjects(cluster.namespace).stream_any, cb=on_event)
            await nc.flush()
            body = {"model": model_name(cluster), "prompt": "a request someone else cancels", "max_tokens": 64,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            started = time.monotonic()
            try:
                async with (httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=CLIENT_TIMEOUT_S) as http,
                            http.stream("POST", "/v1/completions", json=body) as response):
                    assert response.status_code == 200, await response.aread()
                    wanted["id"] = response.headers["x-request-id"]
                    lines = [line async for line in response.aiter_lines()]
            finally:
                await nc.close()
            return read_stream(started, lines)

        outcome = asyncio.run(run())
        assert cancelled, "the request finished before it could be cancelled"
        assert outcome.status == "ok", outcome.detail
        assert gateway_counter(cluster, "halfmoon_migrations_total") == migrations + 1


class TestCrashLoop:
    def test_a_crash_looping_instance_backs_off_and_the_others_serve_on(self, cluster: LocalCluster) -> None:
        # last in the module: transfer-0 stays away for the crash-loop backoff (serving goes on without the pool)
        lines: list[str] = []
        for _ in range(cluster.supervision.policy.crash_loop_exits):
            pid = cluster.procs["transfer-0"].pid
            cluster.kill("transfer-0")
            end = time.monotonic() + 60
            while cluster.procs["transfer-0"].pid == pid and not any("crash-looping" in line for line in lines):
                assert time.monotonic() < end, "the supervisor did not restart transfer-0"
                lines += cluster.supervise()  # what `halfmoon up` calls every second
                time.sleep(0.1)
        report = next(line for line in lines if "crash-looping" in line)
        assert "transfer-0 is crash-looping" in report and "restarting transfer-0 in 300s" in report
        assert cluster.supervision.leaving("transfer-0", time.monotonic()).value == "crash-looping"
        assert {"conductor-0", "prefill-0", "decode-0", "gateway-0", "nats"} <= set(cluster.pids())
        assert_all_served(burst(cluster, [f"served while transfer-0 backs off {i}" for i in range(4)], max_tokens=8))
