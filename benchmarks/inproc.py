"""What the one-process service benchmarks share: a NATS server of their own, and the model they run."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from halfmoon.deploy.processes import free_port, nats_server_binary, wait_for_port
from halfmoon.protocol import codecs
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.stream import TokenEvent
from halfmoon.protocol.subjects import Subjects
from halfmoon.protocol.work import PrefillRequest
from halfmoon.runtime import request


@contextlib.contextmanager
def nats_server() -> Iterator[str]:
    """A nats-server with JetStream (the cache-manager's leadership bucket) on a free loopback port for the
    block; its URL."""
    port = free_port()
    with tempfile.TemporaryDirectory() as store:
        server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port(port, 20, server)
            yield f"nats://127.0.0.1:{port}"
        finally:
            server.terminate()
            server.wait(10)


def model_or_default(model: str | None, tmp: str) -> str:
    """``model``, or a random-initialised 16-layer model (hidden 512, 8 KV heads) written under ``tmp``."""
    if model is not None:
        return model
    from halfmoon.cli.model_tools import make_tiny_model

    return str(make_tiny_model(Path(tmp) / "model", hidden_size=512, layers=16, heads=8, kv_heads=8))


async def timed_request(nc: Any, ns: str, prefill: str, decode: str, prompt: list[int], rid: str,
                        sampling: SamplingParams, pipeline: tuple[str, ...] = ()) -> tuple[float, list[int]]:
    """Submit ``prompt`` to instance ``prefill`` (handing off to ``decode``), as the gateway would; the
    time to its first token (s) and every output token, once the request is done."""
    subjects, done, tokens, first = Subjects(ns), asyncio.Event(), [], []

    async def on_event(msg: Any) -> None:
        event = codecs.STREAM.decode(msg.data)
        assert isinstance(event, TokenEvent), event
        if not first:
            first.append(time.perf_counter())
        tokens.extend(event.token_ids)
        if event.finish_reason is not None:
            done.set()

    sub = await nc.subscribe(subjects.stream("gateway-0", rid), cb=on_event)
    started = time.perf_counter()
    await request(nc, subjects.prefill_submit(prefill, "gateway-0"),
                  PrefillRequest(request_id=rid, prompt_token_ids=tuple(prompt), sampling=sampling,
                                 decode_instance=decode,
                                 deadline=time.time() + 600, pipeline=pipeline), codecs.SUBMIT_REPLY, 30)
    await asyncio.wait_for(done.wait(), 600)
    await sub.unsubscribe()
    return first[0] - started, tokens
