"""A request's token stream is bound to its id and issuing gateway: a worker derives where it streams,
so a forged submit naming another request's stream (the field requests used to carry) streams nowhere
near it, from the gateway's credentials through prefill or from prefill's through decode."""

from __future__ import annotations

import asyncio
import time

import httpx
import msgspec
import pytest

from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol import codecs
from halfmoon.protocol.sampling import SamplingParams
from tests.security.conftest import bearer
from tests.security.test_nats_permissions import SUBJECTS, connect

VICTIM_TOKENS = 40


def forged_prefill(victim_stream: str, n: int) -> list[dict]:
    """What a gateway's credentials may submit to prefill: an invalid request (a token id past the
    vocabulary ends in an ErrorEvent) and one that claims 100 delivered tokens and may add one."""
    base = {"kind": "prefill", "v": 1, "decode_instance": "decode-0", "gateway": "attacker",
            "stream_subject": victim_stream, "deadline": time.time() + 60}
    return [
        {**base, "request_id": f"forged-bad-{n}", "prompt_token_ids": [10**9],
         "sampling": msgspec.to_builtins(SamplingParams(max_tokens=4))},
        {**base, "request_id": f"forged-cut-{n}", "prompt_token_ids": [5, 6, 7], "output_token_ids": [8] * 100,
         "sampling": msgspec.to_builtins(SamplingParams(max_tokens=101, temperature=0, ignore_eos=True))},
    ]


def forged_decode(victim_stream: str, n: int) -> list[dict]:
    """What a prefill's credentials may submit to decode: a hand-off without KV (decode recomputes)."""
    return [{"kind": "decode", "v": 1, "request_id": f"forged-decode-{n}", "prompt_token_ids": [5, 6, 7],
             "first_token_id": 8, "kv": None, "gateway": "attacker", "stream_subject": victim_stream,
             "prefill_instance": "prefill-0", "deadline": time.time() + 60,
             "sampling": msgspec.to_builtins(SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))}]


ATTACKS = {  # credentials, the subject they may submit to, the forged bodies
    "gateway through prefill": ("gateway", SUBJECTS.prefill_submit("prefill-0"), forged_prefill),
    "prefill through decode": ("prefill", SUBJECTS.decode_submit("decode-0"), forged_decode),
}


class TestForgedSubmitCannotWriteIntoAnotherStream:
    @pytest.mark.parametrize("attack", sorted(ATTACKS))
    async def test_victim_stream_gets_only_its_own_events(self, secure_cluster: LocalCluster, served_model: str,
                                                          attack: str) -> None:
        role, submit, forge = ATTACKS[attack]
        attacker = await connect(secure_cluster, role)
        tap = await connect(secure_cluster, "admin")
        seen: dict[str, set[str]] = {}  # stream subject -> request ids of the events on it
        victim_stream: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
            rid = codecs.STREAM.decode(msg.data).request_id
            seen.setdefault(msg.subject, set()).add(rid)
            if not rid.startswith("forged") and not victim_stream.done():
                victim_stream.set_result(msg.subject)

        body = {"model": served_model, "prompt": "a stream nobody else may write into", "max_tokens": VICTIM_TOKENS,
                "ignore_eos": True, "temperature": 0}
        try:
            await tap.subscribe(f"{SUBJECTS.root}.stream.>", cb=on_event)
            await tap.flush()
            async with httpx.AsyncClient(base_url=secure_cluster.url, headers=bearer("tenant-a"), timeout=120) as http:
                pending = asyncio.create_task(http.post("/v1/completions", json=body))
                stream = await asyncio.wait_for(victim_stream, 60)
                replies = []
                for n in range(3):
                    for forged in forge(stream, n):
                        replies.append(await attacker.request(submit, msgspec.msgpack.encode(forged), timeout=10))
                reply = await pending
            # the last forged request's events show where the forged ones stream
            last = forge(stream, 2)[-1]["request_id"]
            end = time.monotonic() + 60
            while all(last not in ids for ids in seen.values()) and time.monotonic() < end:
                await asyncio.sleep(0.1)
            await tap.flush()
        finally:
            await attacker.close()
            await tap.close()
        acks = [codecs.SUBMIT_REPLY.decode(r.data) for r in replies]
        assert all(getattr(a, "instance_id", "") for a in acks), acks  # taken: the attack reached the worker
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert (reply.json()["usage"]["completion_tokens"], choice["finish_reason"]) == (VICTIM_TOKENS, "length")
        assert len(seen[stream]) == 1, seen[stream]  # only the victim's own events
        forged_streams = {s for s, ids in seen.items() if any(i.startswith("forged") for i in ids)}
        assert forged_streams and all(".attacker." in s for s in forged_streams), forged_streams
