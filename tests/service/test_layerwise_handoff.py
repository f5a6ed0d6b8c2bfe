"""Prefill hands KV to decode layer by layer: real NATS, cache-manager, transfer node (shared memory),
prefill and decode services with the tiny model, in one process so the test can hold prefill's last
layer until decode says it has layer 0, an ordering proved by events, not by timing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.hooks import LayerHook
from halfmoon.protocol import codecs
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.stream import TokenEvent
from halfmoon.protocol.subjects import Subjects
from halfmoon.protocol.work import KVProgress, PrefillRequest
from halfmoon.service import ServiceHost, request
from halfmoon.service.worker import WorkerConfig
from halfmoon.services.cache_manager.service import CacheManagerConfig, CacheManagerService
from halfmoon.services.decode.service import DecodeService
from halfmoon.services.prefill.service import PrefillService
from halfmoon.services.transfer.service import TransferConfig, TransferService

SECRET = "layerwise-handoff-tests-secret-0123456789"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i + 3) % 200 + 10 for i in range(40)]  # two full blocks and a partial one


class Cluster(NamedTuple):
    cm: CacheManagerService
    node: TransferService
    prefill: PrefillService
    decode: DecodeService


@pytest.fixture(params=[True, False], ids=["layerwise", "whole-block"])
async def cluster(request, nats_server, namespace: str, tiny_model_dir: Path) -> AsyncIterator[Cluster]:  # type: ignore[no-untyped-def]
    common: dict[str, Any] = dict(nats_url=nats_server.url, namespace=namespace, heartbeat_interval_s=0.1,
                                  cluster_secret=SECRET)
    worker = dict(common, model_dir=str(tiny_model_dir), kv_cache_bytes=8 << 20, layerwise_handoff=request.param,
                  dtype="float32")
    cm = CacheManagerService(CacheManagerConfig(**common))
    node = TransferService(TransferConfig(**common, dram_bytes=16 << 20))
    prefill, decode = PrefillService(WorkerConfig(**worker)), DecodeService(WorkerConfig(**worker))
    async with ServiceHost(cm), ServiceHost(node), ServiceHost(prefill), ServiceHost(decode):
        deadline = time.monotonic() + 30
        while node.instance_id not in cm.nodes or not prefill.transfer_nodes.ordered():
            assert time.monotonic() < deadline, "the transfer node never joined"
            await asyncio.sleep(0.05)
        yield Cluster(cm, node, prefill, decode)


class _Gate(LayerHook):
    """Wraps the engine's own hook; holds the last layer of a prompt's final chunk until ``released``."""

    def __init__(self, inner: LayerHook, last: int, released: threading.Event, wait_s: float,
                 events: list[str]) -> None:
        self.inner, self.last, self.released, self.wait_s, self.events = inner, last, released, wait_s, events

    def before_layer(self, layer, chunks, cache) -> None:  # type: ignore[no-untyped-def]
        if layer == self.last and any(chunk.samples for chunk in chunks):
            self.released.wait(self.wait_s)
            self.events.append("prefill computes its last layer")
        self.inner.before_layer(layer, chunks, cache)

    def after_layer(self, layer, chunks, cache) -> None:  # type: ignore[no-untyped-def]
        self.inner.after_layer(layer, chunks, cache)


async def serve(nc, namespace: str, cluster: Cluster, rid: str) -> list[int]:  # type: ignore[no-untyped-def]
    subjects, tokens, done = Subjects(namespace), [], asyncio.Event()

    async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
        event = codecs.STREAM.decode(msg.data)
        assert isinstance(event, TokenEvent), event
        tokens.extend(event.token_ids)
        if event.finish_reason is not None:
            done.set()

    sub = await nc.subscribe(subjects.stream(rid), cb=on_event)
    await request(nc, subjects.prefill_submit(cluster.prefill.instance_id),
                  PrefillRequest(request_id=rid, prompt_token_ids=tuple(PROMPT), sampling=GREEDY,
                                 decode_instance=cluster.decode.instance_id, stream_subject=subjects.stream(rid),
                                 deadline=time.time() + 120), codecs.SUBMIT_REPLY, 10)
    await asyncio.wait_for(done.wait(), 60)
    await sub.unsubscribe()
    return tokens


class TestLayerwiseHandOff:
    async def test_decode_has_layer_zero_before_prefill_computes_its_last(self, cluster: Cluster, nc,  # type: ignore[no-untyped-def]
                                                                          namespace: str, tiny_model_dir: Path) -> None:
        layerwise = cluster.prefill.config.layerwise_handoff
        events: list[str] = []
        released = threading.Event()
        reader = cluster.decode.layers
        heard = reader.on_progress

        async def spy(msg: KVProgress, context: Any = None) -> None:
            await heard(msg, context)
            events.append(f"decode verified layers 0..{reader.layers_in(msg.request_id) - 1}")
            released.set()

        reader.on_progress = spy  # type: ignore[method-assign]
        receive, streamed_counts = cluster.decode.handoff.receive, []

        async def counting_receive(rid: str, kv: Any, streamed: Any = None) -> Any:
            streamed_counts.append(len(streamed or {}))
            return await receive(rid, kv, streamed)

        cluster.decode.handoff.receive = counting_receive  # type: ignore[method-assign]
        assert cluster.prefill.engine is not None
        last = cluster.prefill.engine.layout.num_layers - 1
        # whole-block has nothing to send before the last layer: the gate gives up after a second
        wait_s = 30.0 if layerwise else 1.0
        await cluster.prefill.engine.call(lambda e: setattr(e.runner, "layer_hook", _Gate(
            e.layer_export, last, released, wait_s, events)))
        tokens = await serve(nc, namespace, cluster, "r-layers")
        expected = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32")).generate([PROMPT], GREEDY)[0]
        assert tokens == expected
        assert streamed_counts == [3]  # every block arrived before the hand-off: none read again
        if layerwise:
            # layers between the first and the last may land before or after the gate opens
            assert events[0] == "decode verified layers 0..0" and "prefill computes its last layer" in events
            assert events[-1] == f"decode verified layers 0..{last}"
        else:
            assert events == ["prefill computes its last layer", f"decode verified layers 0..{last}"]
