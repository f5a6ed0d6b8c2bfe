"""NATS: nobody connects without credentials, and a role's credentials publish only what that
role sends: a gateway cannot submit to decode, end a stream, or declare an instance down; one gateway's
credentials cannot submit in another's name, nor read its streams or its replies; the planner's only listen
to heartbeats, placements and rejections, which the conductor's publish."""

from __future__ import annotations

import asyncio
import time

import httpx
import nats
import nats.errors
import pytest

from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol import codecs
from halfmoon.protocol.permissions import PLANNER, gateway_user, inbox_prefix
from halfmoon.protocol.registry import InstanceDown, Role
from halfmoon.protocol.scheduling import Rejected, RejectReason
from halfmoon.protocol.subjects import Subjects
from tests.security.conftest import bearer

SUBJECTS = Subjects("e2e")  # start_cluster's namespace
VICTIM, ATTACKER = "gateway-0", "gateway-1"  # secure_cluster's gateways: the victim serves its ``url``


async def connect(cluster: LocalCluster, user: str, errors: list[Exception] | None = None):  # type: ignore[no-untyped-def]
    assert cluster.nats_auth is not None

    async def on_error(exc: Exception) -> None:
        if errors is not None:
            errors.append(exc)

    return await nats.connect(cluster.nats_url, error_cb=on_error, allow_reconnect=False,
                              **cluster.nats_auth.connect_options(user))


class TestOutsiderCannotConnect:
    @pytest.mark.parametrize("credentials", [{}, {"user": "gateway", "password": "guessed"},
                                             {"user": "nobody", "password": "x"}])
    async def test_connect_is_refused(self, secure_cluster: LocalCluster, credentials: dict[str, str]) -> None:
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(secure_cluster.nats_url, connect_timeout=5, allow_reconnect=False,
                               max_reconnect_attempts=0, **credentials)


FORGED = {
    "decode submit": SUBJECTS.decode_submit("decode-0"),
    "InstanceDown as the conductor": SUBJECTS.down_from(Role.CONDUCTOR.value),
    "InstanceDown as decode": SUBJECTS.down_from(Role.DECODE.value),
    "a token stream": SUBJECTS.stream("gateway-0", "cmpl-victim"),
    "a decode heartbeat": SUBJECTS.heartbeat_from(Role.DECODE.value),
    "a pipeline stage's chunk": SUBJECTS.prefill_stage("prefill-0"),
    "a prefill submit in another gateway's name": SUBJECTS.prefill_submit("prefill-0", VICTIM),
    "a rejection note": SUBJECTS.rejected,
}


async def refusal(errors: list[Exception], timeout_s: float = 10.0) -> None:
    """Until the server's -ERR for a refused publish or subscribe arrives (asynchronously), or the deadline."""
    end = time.monotonic() + timeout_s
    while not errors and time.monotonic() < end:
        await asyncio.sleep(0.05)


def assert_refused(errors: list[Exception], subject: str) -> None:
    # NOTE: nats-py lower-cases the server's -ERR text (an inbox prefix has capitals)
    assert any("permissions violation" in str(e).lower() and subject.lower() in str(e).lower() for e in errors), errors


class TestGatewayCredentialsCannotImpersonate:
    @pytest.mark.parametrize("what", sorted(FORGED))
    async def test_server_refuses_and_nobody_receives(self, secure_cluster: LocalCluster, what: str) -> None:
        subject = FORGED[what]
        errors: list[Exception] = []
        received: list[str] = []
        gateway = await connect(secure_cluster, gateway_user(ATTACKER), errors)
        tap = await connect(secure_cluster, "admin")

        async def on_message(msg) -> None:  # type: ignore[no-untyped-def]
            if msg.data == b"forged":  # the cluster's own instances publish real messages on some of these subjects
                received.append(msg.subject)

        try:
            await tap.subscribe(subject, cb=on_message)
            await tap.flush()
            await gateway.publish(subject, b"forged")
            await gateway.flush()
            await refusal(errors)
            await tap.flush()
        finally:
            await gateway.close()
            await tap.close()
        assert_refused(errors, subject)
        assert received == []


OTHERS = {  # what one gateway's credentials may not read of another's
    "its token streams": SUBJECTS.streams_of(VICTIM),
    "its request replies": f"{inbox_prefix(gateway_user(VICTIM))}.>",
}


class TestGatewayCredentialsReadOnlyTheirOwn:
    @pytest.mark.parametrize("what", sorted(OTHERS))
    async def test_subscribing_to_another_gateways_traffic_is_refused(self, secure_cluster: LocalCluster,
                                                                      served_model: str, what: str) -> None:
        subject = OTHERS[what]
        errors: list[Exception] = []
        received: list[str] = []
        attacker = await connect(secure_cluster, gateway_user(ATTACKER), errors)

        async def on_message(msg) -> None:  # type: ignore[no-untyped-def]
            received.append(msg.subject)

        body = {"model": served_model, "prompt": "traffic for the victim gateway only", "max_tokens": 8}
        try:
            await attacker.subscribe(subject, cb=on_message)
            await attacker.flush()
            # the victim's traffic: a schedule reply and a submit ack to its inbox, tokens on its streams
            async with httpx.AsyncClient(base_url=secure_cluster.url, headers=bearer("tenant-a"), timeout=120) as http:
                reply = await http.post("/v1/completions", json=body)
            await refusal(errors)
            await attacker.flush()
        finally:
            await attacker.close()
        assert reply.status_code == 200, reply.text
        assert_refused(errors, subject)
        assert received == []


class TestForgedInstanceDownIsIgnored:
    async def test_a_gateway_naming_decode_down_on_its_own_subject_kills_nothing(
            self, secure_cluster: LocalCluster, served_model: str) -> None:
        """The gateway may say goodbye for gateways only; listeners drop an InstanceDown for decode from it."""
        gateway = await connect(secure_cluster, gateway_user(ATTACKER))
        body = {"model": served_model, "prompt": "a stream that must survive", "max_tokens": 24,
                "ignore_eos": True, "temperature": 0}
        try:
            async with httpx.AsyncClient(base_url=secure_cluster.url, headers=bearer("tenant-a"), timeout=120) as http:
                pending = asyncio.create_task(http.post("/v1/completions", json=body))
                for _ in range(20):
                    for victim in ("decode-0", "prefill-0"):
                        down = InstanceDown(instance_id=victim, role=Role(victim.split("-")[0]), reason="forged",
                                            timestamp=time.time())
                        await gateway.publish(SUBJECTS.down_from(Role.GATEWAY.value), codecs.DOWN.encode(down))
                    await gateway.flush()
                    await asyncio.sleep(0.05)
                reply = await pending
        finally:
            await gateway.close()
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 24



PLANNER_MAY_NOT = {  # (publish?, subject)
    "schedule a request": (True, SUBJECTS.schedule),
    "heartbeat as decode": (True, SUBJECTS.heartbeat_from(Role.DECODE.value)),
    "note a placement": (True, SUBJECTS.placed),
    "note a rejection": (True, SUBJECTS.rejected),
    "read a gateway's token streams": (False, SUBJECTS.streams_of(VICTIM)),
    "read the schedule requests": (False, SUBJECTS.schedule),
}


class TestPlannerCredentialsOnlyListen:
    async def test_it_hears_the_heartbeats(self, secure_cluster: LocalCluster) -> None:
        errors: list[Exception] = []
        planner = await connect(secure_cluster, PLANNER, errors)
        beats: list[str] = []

        async def on_beat(msg) -> None:  # type: ignore[no-untyped-def]
            beats.append(codecs.HEARTBEAT.decode(msg.data).instance_id)

        try:
            await planner.subscribe(SUBJECTS.heartbeat, cb=on_beat)
            await planner.subscribe(SUBJECTS.placed)
            await planner.subscribe(SUBJECTS.rejected)
            await planner.flush()
            end = time.monotonic() + 30
            while not beats and time.monotonic() < end:
                await asyncio.sleep(0.05)
        finally:
            await planner.close()
        assert beats and errors == []

    @pytest.mark.parametrize("what", sorted(PLANNER_MAY_NOT))
    async def test_it_may_not_publish_nor_read_anything_else(self, secure_cluster: LocalCluster, what: str) -> None:
        publish, subject = PLANNER_MAY_NOT[what]
        errors: list[Exception] = []
        planner = await connect(secure_cluster, PLANNER, errors)
        try:
            if publish:
                await planner.publish(subject, b"forged")
            else:
                await planner.subscribe(subject)
            await planner.flush()
            await refusal(errors)
        finally:
            await planner.close()
        assert_refused(errors, subject)


class TestConductorCredentialsNoteRejections:
    async def test_a_rejection_the_conductor_notes_reaches_the_planner(self, secure_cluster: LocalCluster) -> None:
        errors: list[Exception] = []
        conductor = await connect(secure_cluster, Role.CONDUCTOR.value, errors)
        planner = await connect(secure_cluster, PLANNER, errors)
        note = Rejected(conductor="conductor-x", request_id="cmpl-noted", reason=RejectReason.OVERLOADED,
                        prompt_tokens=12, max_tokens=8)
        heard: list[Rejected] = []

        async def on_note(msg) -> None:  # type: ignore[no-untyped-def]
            heard.append(codecs.REJECTED.decode(msg.data))

        try:
            await planner.subscribe(SUBJECTS.rejected, cb=on_note)
            await planner.flush()
            await conductor.publish(SUBJECTS.rejected, codecs.REJECTED.encode(note))
            await conductor.flush()
            end = time.monotonic() + 10
            while note not in heard and time.monotonic() < end:
                await asyncio.sleep(0.05)
        finally:
            await conductor.close()
            await planner.close()
        assert note in heard and errors == []
