"""The planner's NATS watch on a real NATS server: rejected requests are demand, and a request counts once
however often it was rejected and placed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import nats
import pytest
from nats.aio.client import Client

from halfmoon.deploy.planner import Report, Watch
from halfmoon.protocol import codecs
from halfmoon.protocol.scheduling import Placed, Rejected, RejectReason
from halfmoon.protocol.subjects import Subjects
from halfmoon.sim.forecast import IntervalLoad
from tests.conftest import NatsServer

COUNTED = ("requests", "rejected", "prompt_tokens", "output_tokens", "placed_prompt_tokens", "reused_tokens")


@pytest.fixture
def watch(nats_server: NatsServer, namespace: str) -> Iterator[Watch]:
    watching = Watch(lambda: nats.connect(nats_server.url, connect_timeout=5), Subjects(namespace))
    watching.start()
    yield watching
    watching.stop()


def placed(request_id: str, prompt: int, reused: int = 0) -> Placed:
    return Placed(conductor="conductor-0", prefill_instance="p0", decode_instance="d0", request_id=request_id,
                  prompt_tokens=prompt, max_tokens=16, reused_tokens=reused)


def rejected(request_id: str, prompt: int) -> Rejected:
    return Rejected(conductor="conductor-0", request_id=request_id, reason=RejectReason.OVERLOADED,
                    prompt_tokens=prompt, max_tokens=16)


async def send(nc: Client, subjects: Subjects, *notes: Placed | Rejected) -> None:
    for note in notes:
        codec = codecs.PLACED if isinstance(note, Placed) else codecs.REJECTED
        await nc.publish(subjects.placed if isinstance(note, Placed) else subjects.rejected, codec.encode(note))
    await nc.flush()


async def heard(watch: Watch, requests: int, timeout_s: float = 10.0) -> dict[str, int]:
    """What the watch counted (over as many ``take`` calls as it took) once ``requests`` requests were heard.

    Notes of one subject are handled in the order sent, so the last note of each batch sent is a new request:
    once it is counted, so is everything sent before it on its subject."""
    total = dict.fromkeys(COUNTED, 0)
    end = time.monotonic() + timeout_s
    while total["requests"] < requests:
        assert time.monotonic() < end, f"heard {total} within {timeout_s}s, not {requests} requests"
        report = watch.take()
        for name in COUNTED:
            total[name] += getattr(report, name)
        await asyncio.sleep(0.02)
    return total


class TestWatchCountsDemand:
    async def test_a_request_rejected_twice_then_placed_counts_once(self, watch: Watch, nc: Client,
                                                                    namespace: str) -> None:
        subjects = Subjects(namespace)
        # r1 turned away twice (the gateway retried it), r2 once
        await send(nc, subjects, rejected("r1", 100), rejected("r1", 100), rejected("r2", 40))
        assert await heard(watch, 2) == {"requests": 2, "rejected": 2, "prompt_tokens": 140, "output_tokens": 32,
                                         "placed_prompt_tokens": 0, "reused_tokens": 0}
        # r1's retry is placed at last: no new request, but its reuse is known now; r3 is placed at once
        await send(nc, subjects, placed("r1", 100, reused=50), placed("r3", 60, reused=10))
        assert await heard(watch, 1) == {"requests": 1, "rejected": 0, "prompt_tokens": 60, "output_tokens": 16,
                                         "placed_prompt_tokens": 160, "reused_tokens": 60}
        # placed again (a migration), and rejected after its placement: neither is a new request
        await send(nc, subjects, placed("r3", 60, reused=10), placed("r4", 20))
        await send(nc, subjects, rejected("r1", 100), rejected("r3", 60), rejected("r5", 30))
        assert await heard(watch, 2) == {"requests": 2, "rejected": 1, "prompt_tokens": 50, "output_tokens": 32,
                                         "placed_prompt_tokens": 20, "reused_tokens": 0}


class TestReportLoad:
    def report(self, requests: int, placed_prompt: int, reused: int) -> Report:
        return Report(requests=requests, rejected=2, prompt_tokens=400, output_tokens=80,
                      placed_prompt_tokens=placed_prompt, reused_tokens=reused, tbt_ms={}, block_size=16)

    def test_rejected_requests_are_load_and_reuse_is_the_placements(self) -> None:
        # 4 requests in 2 s, 2 of them rejected: the placed 2 (200 prompt tokens) reused half of theirs
        assert self.report(4, 200, 100).load(2.0) == IntervalLoad(2.0, 100.0, 20.0, 0.5)

    def test_an_interval_of_rejections_only_plans_for_no_reuse(self) -> None:
        assert self.report(4, 0, 0).load(2.0) == IntervalLoad(2.0, 100.0, 20.0, 0.0)
