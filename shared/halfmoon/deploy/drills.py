"""Fault drills against a LocalCluster: steady streaming load, one fault at a time, and what each request saw.

Used by tests/faults (pass/fail) and benchmarks/faults.py (the table in docs/RELIABILITY.md). A request
ends one of three ways: ``ok`` (a complete stream ending in [DONE]), ``error`` (an HTTP error or SSE error
event with a message, within its deadline) or ``lost`` (anything else: a hang past the deadline, a broken
connection, a stream that stops without a word).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import httpx
import nats
from nats.aio.msg import Msg

from halfmoon.deploy.local import LocalCluster
from halfmoon.deploy.processes import wait_for_port
from halfmoon.deploy.topology import SERVICES
from halfmoon.protocol import codecs
from halfmoon.protocol.registry import Heartbeat
from halfmoon.protocol.stream import TokenEvent
from halfmoon.protocol.subjects import Subjects

Status = Literal["ok", "error", "lost"]


@dataclass(frozen=True)
class Outcome:
    started: float  # time.monotonic()
    ended: float
    status: Status
    detail: str = ""
    text: str = ""


@dataclass
class StreamingLoad:
    """``clients`` concurrent streaming clients, each sending one request after another until stopped."""

    url: str
    model: str
    clients: int = 4
    max_tokens: int = 48
    deadline_s: float = 90.0
    headers: dict[str, str] = field(default_factory=dict)  # e.g. the API key
    outcomes: list[Outcome] = field(default_factory=list)
    in_flight: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> StreamingLoad:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.deadline_s + 10)
        return self.outcomes

    def wait(self, what: str, condition: Callable[[], bool], timeout: float = 120.0) -> None:
        end = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > end:
                raise TimeoutError(f"load: {what} not reached in {timeout}s")
            time.sleep(0.05)

    def completed_since(self, t: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.started >= t and o.status == "ok"]

    async def _run(self) -> None:
        timeout = httpx.Timeout(self.deadline_s, connect=10)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout, headers=self.headers) as http:
            await asyncio.gather(*(self._client(http, i) for i in range(self.clients)))

    async def _client(self, http: httpx.AsyncClient, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            prompt = f"client {n} asks question {i} about the moon and its halves"
            started = time.monotonic()
            self.in_flight += 1
            try:
                outcome = await asyncio.wait_for(self._one(http, prompt, started), self.deadline_s)
            except TimeoutError:
                outcome = Outcome(started, time.monotonic(), "lost", "no end within the deadline")
            finally:
                self.in_flight -= 1
            self.outcomes.append(outcome)
            i += 1

    async def _one(self, http: httpx.AsyncClient, prompt: str, started: float) -> Outcome:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    message = json.loads(await response.aread())["error"]["message"]
                    return Outcome(started, time.monotonic(), "error", f"{response.status_code}: {message}")
                return read_stream(started, [line async for line in response.aiter_lines()])
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return Outcome(started, time.monotonic(), "lost", f"{type(exc).__name__}: {exc}")


def read_stream(started: float, lines: list[str]) -> Outcome:
    """Judge one SSE response: complete, a clear error event, or cut off."""
    text: list[str] = []
    finish = None
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            status: Status = "ok" if finish else "lost"
            return Outcome(started, time.monotonic(), status, "" if finish else "[DONE] without a finish", "".join(text))
        chunk = json.loads(payload)
        if "error" in chunk:
            return Outcome(started, time.monotonic(), "error", chunk["error"]["message"], "".join(text))
        for choice in chunk.get("choices", ()):
            text.append(choice.get("text", ""))
            finish = choice.get("finish_reason") or finish
    return Outcome(started, time.monotonic(), "lost", "stream ended without [DONE] or an error", "".join(text))


def under_load(url: str, model: str, fault: Callable[[], object], clients: int = 3, max_tokens: int = 48,
               after: int = 3, headers: dict[str, str] | None = None) -> tuple[list[Outcome], float]:
    """Run ``fault()`` once ``clients`` streams are in flight; stop once ``after`` requests that started
    after the fault completed. Returns every request's outcome and when the fault began."""
    load = StreamingLoad(url, model, clients=clients, max_tokens=max_tokens, headers=headers or {}).start()
    try:
        load.wait("warm-up", lambda: len(load.completed_since(0)) >= 2 and load.in_flight >= clients)
        at = time.monotonic()
        fault()
        load.wait(f"{after} completions after the fault", lambda: len(load.completed_since(at)) >= after)
    finally:
        outcomes = load.stop()
    return outcomes, at


# ---------------------------------------------------------------------------------------- faults
def restart(cluster: LocalCluster, instance_id: str) -> None:
    """Start a stopped or killed instance again (any id of a known service: ``transfer-1`` adds one)."""
    spec = next(s for s in SERVICES if instance_id.rsplit("-", 1)[0] == s.name)
    cluster.start_instance(spec, instance_id)


def kill_while_streaming(cluster: LocalCluster, instance_id: str, timeout: float = 60.0) -> None:
    """SIGKILL ``instance_id`` as soon as it streams a token: it certainly holds a request when it dies."""
    async def watch() -> None:
        nc = await operator_nats(cluster)
        streaming = asyncio.Event()

        async def on_event(msg: Msg) -> None:
            event = codecs.STREAM.decode(msg.data)
            if isinstance(event, TokenEvent) and event.instance_id == instance_id:
                streaming.set()

        try:
            await nc.subscribe(Subjects(cluster.namespace).stream_any, cb=on_event)
            await asyncio.wait_for(streaming.wait(), timeout)
        finally:
            await nc.close()

    asyncio.run(watch())
    cluster.kill(instance_id)


@contextmanager
def stopped(cluster: LocalCluster, instance_id: str) -> Iterator[None]:
    """SIGSTOP an instance for the duration (a stall: alive, silent), then SIGCONT."""
    pid = cluster.procs[instance_id].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def restart_nats(cluster: LocalCluster, down_s: float) -> None:
    """SIGKILL the cluster's NATS server, keep it away ``down_s`` seconds, start it again on the same port."""
    proc = cluster._nats  # the launcher owns the server; drills replace it in place
    assert proc is not None and cluster.nats_url is not None, "the cluster did not start its own NATS"
    proc.kill()
    proc.wait()
    time.sleep(down_s)
    port = int(cluster.nats_url.rsplit(":", 1)[1])
    cluster.respawn_nats()  # the launcher's config and port: same users and permissions
    respawned = cluster._nats
    assert respawned is not None, "the launcher did not respawn its NATS"
    wait_for_port(port, 15, respawned)


def heartbeats(cluster: LocalCluster, listen_s: float) -> dict[str, Heartbeat]:
    """The latest heartbeat of every instance heard within ``listen_s`` seconds."""
    async def listen() -> dict[str, Heartbeat]:
        seen: dict[str, Heartbeat] = {}
        nc = await operator_nats(cluster)

        async def on_beat(msg: Msg) -> None:
            beat = codecs.HEARTBEAT.decode(msg.data)
            seen[beat.instance_id] = beat

        await nc.subscribe(Subjects(cluster.namespace).heartbeat, cb=on_beat)
        await asyncio.sleep(listen_s)
        await nc.close()
        return seen

    return asyncio.run(listen())


async def operator_nats(cluster: LocalCluster) -> nats.NATS:
    """A NATS connection with the operator's credentials (when the cluster has any): taps see every subject."""
    assert cluster.nats_url is not None, "the cluster has not started"
    options = cluster.nats_auth.connect_options() if cluster.nats_auth is not None else {}
    return await nats.connect(cluster.nats_url, connect_timeout=5, **options)


def wait_live(cluster: LocalCluster, instance_ids: set[str], timeout: float = 120.0) -> float:
    """Block until every one of ``instance_ids`` heartbeats; the monotonic time it happened."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if instance_ids <= set(heartbeats(cluster, 0.6)):
            return time.monotonic()
    raise TimeoutError(f"{sorted(instance_ids)} not heartbeating after {timeout}s")


def gateway_counter(cluster: LocalCluster, name: str) -> float:
    """Sum of one counter family on the gateway's /metrics (every label set)."""
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and "_created" not in line.split(" ")[0])
