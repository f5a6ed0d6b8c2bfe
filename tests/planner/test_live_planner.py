"""`halfmoon up --planner` on the tiny model under a low, high, low load: aggregated instances are added under
the burst and drained after it, and every request sent completes, once, whole.

The planner's capacity comes from configuration, never from this machine's speed: its cost profile
(tests/planner/conftest.py) says an instance holds two requests of 16 tokens within a TBT SLO of 200 ms, and
the load is open-loop (sent at a fixed rate, not as fast as answers come back), so the rate the planner sees
is the rate sent. The conductor's own SLOs are set loose, so that it admits every request on a loaded machine:
the test is about the pools' size, not admission.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from pathlib import Path

import httpx
import psutil
import pytest

from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol import codecs
from halfmoon.protocol.stream import TokenEvent
from halfmoon.protocol.subjects import Subjects
from tests.conftest import Processes
from tests.deploy.test_launcher_supervision import Up
from tests.e2e.conftest import AUTH, admin_nats, model_name, start_cluster
from tests.planner.conftest import TBT_SLO_S, capped_profile_dict

LOW_RPS, HIGH_RPS = 0.2, 4.0
MAX_TOKENS = 16
IN_FLIGHT = 12  # at most this many requests open at once: a slow machine gets a lower rate, never a pile-up
INTERVAL_S = 2.0
LOW_INTERVALS = 3  # decisions seen at low load before the burst
DEADLINE_S = 420.0
# the conductor's SLOs (the planner has its own, by flag): a loaded machine's real TBT must not get requests
# rejected, and spans are exported at once
CONDUCTOR_ADMITS_ALL = {"HALFMOON_TTFT_SLO_S": "900", "HALFMOON_TBT_SLO_S": "60", "OTEL_BSP_SCHEDULE_DELAY": "100"}


class Load:
    """Open-loop requests at a rate that the test changes; every response is kept."""

    def __init__(self, url: str) -> None:
        self.model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        self.rps = LOW_RPS
        self.results: list[tuple[int, list[str], str, str]] = []  # status, tokens, finish reason, request id
        self.sent = 0
        self._slots = asyncio.Semaphore(IN_FLIGHT)
        self._tasks: set[asyncio.Task[None]] = set()

    async def one(self, http: httpx.AsyncClient, n: int) -> None:
        body = {"model": self.model, "prompt": f"request {n} of the ramp", "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "stream": True}
        tokens: list[str] = []
        finish, rid = "", ""
        try:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                rid = response.headers.get("x-request-id", "")
                if response.status_code != 200:
                    self.results.append((response.status_code, tokens, (await response.aread()).decode(), rid))
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        finish = f"error: {chunk['error']}"
                        continue
                    for choice in chunk["choices"]:
                        if choice["logprobs"]:
                            tokens.extend(choice["logprobs"]["tokens"])
                        finish = choice["finish_reason"] or finish
            self.results.append((200, tokens, finish, rid))
        finally:
            self._slots.release()

    async def run_until(self, http: httpx.AsyncClient, done: asyncio.Event) -> None:
        next_at = time.monotonic()
        while not done.is_set():
            await self._slots.acquire()
            task = asyncio.create_task(self.one(http, self.sent))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            self.sent += 1
            next_at += 1.0 / self.rps
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), max(0.0, next_at - time.monotonic()))
            next_at = max(next_at, time.monotonic() - 1.0)  # behind after a full window: no catch-up burst
        await asyncio.gather(*self._tasks)


def decisions(up: Up) -> list[str]:
    """The planner's decision lines, without their timestamps."""
    path = up.run_dir / "logs" / "planner.log"
    return [line.split(" ", 1)[1] for line in path.read_text().splitlines()] if path.exists() else []


def aggregated_target(line: str) -> int:
    match = re.search(r"-> (\d+) aggregated:", line)
    assert match, line
    return int(match.group(1))


async def wait_for(condition, what: str, deadline: float) -> None:  # type: ignore[no-untyped-def]
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within the test's deadline"
        await asyncio.sleep(0.5)


@pytest.mark.timeout(900)
def test_adds_instances_under_a_burst_and_drains_them_after(tiny_model_dir: Path, tmp_path: Path) -> None:
    profile = tmp_path / "capped-profile.json"
    profile.write_text(json.dumps(capped_profile_dict()))
    processes = Processes()
    up = Up(processes, tiny_model_dir, tmp_path / "run", "--port", "0", "--aggregated", "1",
            "--planner", "--planner-profile", str(profile), "--planner-interval", str(INTERVAL_S),
            "--planner-max-instances", "3", "--planner-tbt-slo", str(TBT_SLO_S), "--planner-ttft-slo", "30",
            env=CONDUCTOR_ADMITS_ALL)
    try:
        up.wait_for_output("planner: sizing the engine pools every 2 s")
        asyncio.run(ramp(up))
    finally:
        up.stop()
        processes.stop_all()
    text = up.text()
    assert up.proc.returncode == 0, text
    spans = [json.loads(line) for line in (up.run_dir / "traces.jsonl").read_text().splitlines()]
    actions = {s["attributes"]["planner.action"] for s in spans if s["name"] == "planner.decide"}
    assert {"up", "down", "hold"} <= actions, actions


async def ramp(up: Up) -> None:
    deadline = time.monotonic() + DEADLINE_S
    load = Load(up.url)
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=up.url, timeout=httpx.Timeout(300, connect=10)) as http:
        sending = asyncio.create_task(load.run_until(http, stop))
        # low: the planner holds one instance
        await wait_for(lambda: len(decisions(up)) >= LOW_INTERVALS, "decisions at low load", deadline)
        low = decisions(up)
        assert all(line.startswith("hold 1 aggregated -> 1 aggregated") for line in low), low
        # high: it adds instances, which come up and serve
        load.rps = HIGH_RPS
        await wait_for(lambda: any(line.startswith("up ") for line in decisions(up)), "a scale-up", deadline)
        scaled = next(line for line in decisions(up) if line.startswith("up "))
        assert "started aggregated-1" in scaled, scaled
        await wait_for(lambda: "aggregated-1 serving (pid" in up.text(), "aggregated-1 serving", deadline)
        # low again: it drains them one at a time, back to one, while the low load goes on
        load.rps = LOW_RPS
        await wait_for(lambda: aggregated_target(decisions(up)[-1]) == 1
                       and any(line.startswith("down ") for line in decisions(up)), "back to one instance", deadline)
        stop.set()
        await sending
    lines = decisions(up)
    most = max(aggregated_target(line) for line in lines)
    downs = [line for line in lines if line.startswith("down ")]
    assert len(downs) == most - 1, lines  # one step at a time
    drained = [re.search(r"draining (aggregated-\d+)", line) for line in downs]
    assert all(drained), downs
    for instance in (m.group(1) for m in drained if m):
        # it exits by itself and nothing restarts it; one that served drained first (a SIGTERM before its
        # start was done ends it at once: it held nothing)
        info = up.ready(instance)
        if info is not None:
            await wait_for(lambda pid=info["pid"]: not psutil.pid_exists(pid), f"{instance} exiting",
                           time.monotonic() + 60)
            assert "service stopped" in (up.run_dir / "logs" / f"{instance}.log").read_text()
        assert f"{instance} restarted" not in up.text()
    # every request sent came back whole, each token once
    assert len(load.results) == load.sent
    bad = [r for r in load.results if r[0] != 200 or len(r[1]) != MAX_TOKENS or r[2] != "length"]
    assert not bad, bad[:5]


LONG_TOKENS = 400
RETIRE_AFTER = 20  # tokens the instance has streamed before it is drained


@pytest.mark.timeout(600)
def test_an_instance_drained_mid_stream_finishes_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Scale-down's mechanism with work in flight: the instance streaming a request is retired (SIGTERM, as the
    local actuator does); it finishes the stream, each token once, exits by itself, and is not restarted,
    while the other instance takes the next request."""
    cluster = start_cluster(tiny_model_dir, tmp_path, env=CONDUCTOR_ADMITS_ALL, conductor=1, prefill=0,
                            decode=0, aggregated=2)
    try:
        holder, after, tokens, finish = asyncio.run(drain_mid_stream(cluster))
        assert after > 0, "the instance streamed nothing after its SIGTERM: nothing was in flight"
        assert len(tokens) == LONG_TOKENS and finish == "length"  # every token, each once
        assert cluster.procs[holder].wait(timeout=60) == 0  # drained, said goodbye, exited by itself
        assert not cluster.supervise() and cluster.members("aggregated") == [
            iid for iid in ("aggregated-0", "aggregated-1") if iid != holder]
        assert "service stopped" in cluster.log_file(holder).read_text()
        model = model_name(cluster)
        reply = httpx.post(f"{cluster.url}/v1/completions", headers=AUTH, timeout=120,
                           json={"model": model, "prompt": "after the drain", "max_tokens": 4, "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    finally:
        cluster.stop()


async def drain_mid_stream(cluster: LocalCluster) -> tuple[str, int, list[str], str]:
    """Streams one long request, retires its instance once it has streamed ``RETIRE_AFTER`` tokens; returns
    the instance, how many token events it published after that, and what the client got: the tokens and
    the finish reason."""
    nc = await admin_nats(cluster)
    events: list[TokenEvent] = []
    retired: list[str] = []
    after = 0

    async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
        nonlocal after
        event = codecs.STREAM.decode(msg.data)
        if not isinstance(event, TokenEvent):
            return
        events.append(event)
        if retired and event.instance_id == retired[0]:
            after += 1
        elif not retired and sum(len(e.token_ids) for e in events) >= RETIRE_AFTER:
            retired.append(event.instance_id)
            cluster.retire_instance(event.instance_id)

    await nc.subscribe(Subjects(cluster.namespace).stream_any, cb=on_event)
    await nc.flush()
    body = {"model": model_name(cluster), "prompt": "a long answer", "max_tokens": LONG_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True}
    tokens: list[str] = []
    finish = ""
    async with (httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=httpx.Timeout(300, connect=10)) as http,
                http.stream("POST", "/v1/completions", json=body) as response):
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[len("data: "):])["choices"]:
                    tokens.extend((choice["logprobs"] or {}).get("tokens", []))
                    finish = choice["finish_reason"] or finish
    await nc.close()
    assert retired, "the stream ended before its instance could be retired"
    return retired[0], after, tokens, finish
