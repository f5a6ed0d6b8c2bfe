"""A request's token stream is bound to its id and issuing gateway: a worker derives where it streams,
prefill from the subject the submit came on (a gateway's NATS user may only submit naming itself). So a
forged submit naming another request's gateway and id streams nowhere near it: from another gateway's
credentials through prefill, or from prefill's through decode."""

from __future__ import annotations

import asyncio
import time

import httpx
import msgspec
import pytest

from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol import codecs
from halfmoon.protocol.base import ErrorReply
from halfmoon.protocol.permissions import gateway_user
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.stream import ErrorEvent, TokenEvent
from tests.security.conftest import bearer
from tests.security.test_nats_permissions import ATTACKER, SUBJECTS, connect

VICTIM_TOKENS = 40
TAKE_DEADLINE_S = 30.0


def forged_prefill(victim_gateway: str, victim_id: str) -> list[dict]:
    """What another gateway's credentials may submit to prefill, naming the victim's gateway (in the field
    requests used to carry) and request id, both read off the victim's stream subject: an invalid request
    (a token id past the vocabulary ends in an ErrorEvent) and one that claims 100 delivered tokens and may
    add one (a TokenEvent at index 100)."""
    base = {"kind": "prefill", "v": 1, "decode_instance": "decode-0", "gateway": victim_gateway,
            "request_id": victim_id, "deadline": time.time() + 60}
    return [
        {**base, "prompt_token_ids": [10**9], "sampling": msgspec.to_builtins(SamplingParams(max_tokens=4))},
        {**base, "prompt_token_ids": [5, 6, 7], "output_token_ids": [8] * 100,
         "sampling": msgspec.to_builtins(SamplingParams(max_tokens=101, temperature=0, ignore_eos=True))},
    ]


def forged_decode(_victim_gateway: str, victim_id: str) -> list[dict]:
    """What a prefill's credentials may submit to decode: a hand-off without KV (decode recomputes), under
    a request id of its own (prefill is trusted with every stream: this checks only that decode derives it)."""
    return [{"kind": "decode", "v": 1, "request_id": f"forged-{victim_id}", "prompt_token_ids": [5, 6, 7],
             "first_token_id": 8, "kv": None, "gateway": "attacker",
             "prefill_instance": "prefill-0", "deadline": time.time() + 60,
             "sampling": msgspec.to_builtins(SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))}]


ATTACKS = {  # credentials, the subject they may submit to, the forged bodies, where those must stream
    "another gateway through prefill": (gateway_user(ATTACKER), SUBJECTS.prefill_submit("prefill-0", ATTACKER),
                                        forged_prefill, f".stream.{ATTACKER}."),
    "prefill through decode": ("prefill", SUBJECTS.decode_submit("decode-0"), forged_decode, ".stream.attacker."),
}


def forged(event: TokenEvent | ErrorEvent) -> bool:
    """What the victim's own request never streams: an error, or a token past its last."""
    return isinstance(event, ErrorEvent) or event.index >= VICTIM_TOKENS or event.request_id.startswith("forged")


async def submit_until_taken(nc, subject: str, body: dict) -> bool:  # type: ignore[no-untyped-def]
    """Submit until the worker takes it: it refuses a request id it still serves ("already here")."""
    end = time.monotonic() + TAKE_DEADLINE_S
    while True:
        reply = codecs.SUBMIT_REPLY.decode((await nc.request(subject, msgspec.msgpack.encode(body), timeout=10)).data)
        if not isinstance(reply, ErrorReply):
            return True
        if "already here" not in reply.message or time.monotonic() > end:
            return False
        await asyncio.sleep(0.05)


class TestForgedSubmitCannotWriteIntoAnotherStream:
    @pytest.mark.parametrize("attack", sorted(ATTACKS))
    async def test_victim_stream_gets_only_its_own_events(self, secure_cluster: LocalCluster, served_model: str,
                                                          attack: str) -> None:
        user, submit, forge, forged_prefix = ATTACKS[attack]
        attacker = await connect(secure_cluster, user)
        tap = await connect(secure_cluster, "admin")
        seen: dict[str, list[TokenEvent | ErrorEvent]] = {}  # stream subject -> the events on it
        victim_stream: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
            event = codecs.STREAM.decode(msg.data)
            seen.setdefault(msg.subject, []).append(event)
            # NOTE: once decode streams, prefill is done with the request: a submit reusing its id is taken
            if event.instance_id.startswith("decode") and not forged(event) and not victim_stream.done():
                victim_stream.set_result(msg.subject)

        body = {"model": served_model, "prompt": "a stream nobody else may write into", "max_tokens": VICTIM_TOKENS,
                "ignore_eos": True, "temperature": 0}
        try:
            await tap.subscribe(f"{SUBJECTS.root}.stream.>", cb=on_event)
            await tap.flush()
            async with httpx.AsyncClient(base_url=secure_cluster.url, headers=bearer("tenant-a"), timeout=120) as http:
                pending = asyncio.create_task(http.post("/v1/completions", json=body))
                stream = await asyncio.wait_for(victim_stream, 60)
                victim_gateway, victim_id = stream.rsplit(".", 2)[-2:]
                taken = [await submit_until_taken(attacker, submit, b) for b in forge(victim_gateway, victim_id)]
                reply = await pending
            end = time.monotonic() + 60
            while sum(forged(e) for events in seen.values() for e in events) < len(taken) and time.monotonic() < end:
                await asyncio.sleep(0.1)
            await tap.flush()
        finally:
            await attacker.close()
            await tap.close()
        assert all(taken), taken  # the attack reached the worker
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert (reply.json()["usage"]["completion_tokens"], choice["finish_reason"]) == (VICTIM_TOKENS, "length")
        assert [e for e in seen[stream] if forged(e)] == []  # only the victim's own events
        forged_streams = {s for s, events in seen.items() if any(forged(e) for e in events)}
        assert forged_streams and all(forged_prefix in s for s in forged_streams), forged_streams
