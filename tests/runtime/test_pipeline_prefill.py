"""Chunked pipeline-parallel prefill (CPP) live: a long prompt prefilled by two prefill instances, each
running half of the layers chunk by chunk, then decoded from the blocks both wrote into the pool. Real NATS,
cache-manager, transfer node (shared memory), two prefill services and a decode service with the tiny
model, in one process so the test can look at what decode read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.protocol import codecs
from halfmoon.protocol.base import ErrorCode, RemoteError
from halfmoon.protocol.pipeline import StageWork
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.stream import ErrorEvent, TokenEvent
from halfmoon.protocol.subjects import Subjects
from halfmoon.protocol.work import PrefillRequest
from halfmoon.runtime import ServiceHost, request
from halfmoon.runtime.worker import WorkerConfig
from halfmoon.services.cache_manager.service import CacheManagerConfig, CacheManagerService
from halfmoon.services.decode.service import DecodeService
from halfmoon.services.prefill.service import PrefillService
from halfmoon.services.transfer.service import TransferConfig, TransferService
from halfmoon.telemetry.metrics import METRICS

SECRET = "pipeline-prefill-tests-secret-0123456789"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CHUNK = 32  # prefill_chunk_size of every engine: the single-instance reference computes the same chunks
PROMPT = [(11 * i + 5) % 250 + 3 for i in range(150)]  # 9 full blocks and a partial one, 5 chunks


class Cluster(NamedTuple):
    cm: CacheManagerService
    node: TransferService
    head: PrefillService
    tail: PrefillService
    mid: PrefillService
    decode: DecodeService


@pytest.fixture
async def cluster(nats_server: Any, namespace: str, tiny_model_dir: Path) -> AsyncIterator[Cluster]:
    common: dict[str, Any] = dict(nats_url=nats_server.url, namespace=namespace, heartbeat_interval_s=0.1,
                                  cluster_secret=SECRET)
    worker = dict(common, model_dir=str(tiny_model_dir), dtype="float32", kv_cache_bytes=8 << 20,
                  prefill_chunk_size=CHUNK)
    cm = CacheManagerService(CacheManagerConfig(**common, leadership_ttl_s=30.0))  # as conftest.running: one event loop
    node = TransferService(TransferConfig(**common, dram_bytes=16 << 20))
    head, tail, mid = (PrefillService(WorkerConfig(**worker)) for _ in range(3))
    decode = DecodeService(WorkerConfig(**worker))
    async with (ServiceHost(cm), ServiceHost(node), ServiceHost(head), ServiceHost(tail), ServiceHost(mid),
                ServiceHost(decode)):
        deadline = time.monotonic() + 30
        while node.instance_id not in cm.nodes or not all(p.transfer_nodes.ordered() for p in (head, tail, mid)):
            assert time.monotonic() < deadline, "the transfer node never joined"
            await asyncio.sleep(0.05)
        yield Cluster(cm, node, head, tail, mid, decode)


async def serve(nc: Any, namespace: str, cluster: Cluster, rid: str,
                pipeline: tuple[str, ...]) -> list[TokenEvent | ErrorEvent]:
    subjects, events, done = Subjects(namespace), [], asyncio.Event()

    async def on_event(msg: Any) -> None:
        event = codecs.STREAM.decode(msg.data)
        events.append(event)
        if isinstance(event, ErrorEvent) or event.finish_reason is not None:
            done.set()

    sub = await nc.subscribe(subjects.stream("gateway-0", rid), cb=on_event)
    await request(nc, subjects.prefill_submit(cluster.head.instance_id, "gateway-0"),
                  PrefillRequest(request_id=rid, prompt_token_ids=tuple(PROMPT), sampling=GREEDY,
                                 decode_instance=cluster.decode.instance_id,
                                 deadline=time.time() + 120, pipeline=pipeline), codecs.SUBMIT_REPLY, 10)
    await asyncio.wait_for(done.wait(), 90)
    await sub.unsubscribe()
    return events


def spy_on_decode(cluster: Cluster) -> list[tuple[Any, int]]:
    """What decode is handed (the KV's locations) and how many blocks of it verify, request by request."""
    receive, received = cluster.decode.handoff.receive, []

    async def spy(rid: str, kv: Any, streamed: Any = None) -> Any:
        payloads = await receive(rid, kv, streamed)
        received.append((kv, len(payloads)))
        return payloads

    cluster.decode.handoff.receive = spy  # type: ignore[method-assign]
    return received


def chunks_run(stage: str) -> float:
    return METRICS.pipeline_chunks.labels(stage)._value.get()


class TestTwoStagesEqualOneInstance:
    async def test_tokens_equal_single_instance_prefill_and_decode_reads_every_block(
            self, cluster: Cluster, nc: Any, namespace: str, tiny_model_dir: Path) -> None:
        received = spy_on_decode(cluster)
        before = chunks_run("1")
        events = await serve(nc, namespace, cluster, "r-cpp", (cluster.tail.instance_id,))
        tokens = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
        reference = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", prefill_chunk_size=CHUNK))
        assert tokens == reference.generate([PROMPT], GREEDY)[0]
        assert events[0].instance_id == cluster.head.instance_id  # the head streams the first token
        assert chunks_run("1") - before == 5  # every chunk went through the second stage
        (kv, usable), = received
        assert kv is not None and len(kv.blocks) == 9 and kv.partial is not None
        assert usable == 10  # every block verified: both stages' layers under one salt and key
        assert not (await cluster.head.engine.call(lambda e: e.stages.held()))  # type: ignore[union-attr]
        assert not (await cluster.tail.engine.call(lambda e: e.stages.held()))  # type: ignore[union-attr]


class TestReusedPrefix:
    async def test_second_time_every_stage_loads_the_prefix_from_the_pool(self, cluster: Cluster, nc: Any,
                                                                         namespace: str, tiny_model_dir: Path) -> None:
        stage = (cluster.tail.instance_id,)
        first = await serve(nc, namespace, cluster, "r-cold", stage)
        before = chunks_run("1")
        again = await serve(nc, namespace, cluster, "r-warm", stage)
        tokens = [[t for e in events if isinstance(e, TokenEvent) for t in e.token_ids] for events in (first, again)]
        reference = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", prefill_chunk_size=CHUNK))
        assert tokens == [reference.generate([PROMPT], GREEDY)[0]] * 2
        assert chunks_run("1") - before == 1  # 9 blocks reused: the last 6 tokens are one chunk
        (usage,) = [e.usage for e in again if isinstance(e, TokenEvent) and e.usage is not None]
        assert usage.cached_tokens == 144


class TestThreeStages:
    async def test_a_middle_stage_passes_chunks_on(self, cluster: Cluster, nc: Any, namespace: str,
                                                    tiny_model_dir: Path) -> None:
        received = spy_on_decode(cluster)
        before = chunks_run("1"), chunks_run("2")
        events = await serve(nc, namespace, cluster, "r-cpp3", (cluster.mid.instance_id, cluster.tail.instance_id))
        tokens = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
        reference = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", prefill_chunk_size=CHUNK))
        assert tokens == reference.generate([PROMPT], GREEDY)[0]
        assert (chunks_run("1") - before[0], chunks_run("2") - before[1]) == (5, 5)
        assert [usable for _, usable in received] == [10]  # three stages' layers in every block, all verified
        for svc in (cluster.head, cluster.mid, cluster.tail):
            assert not (await svc.engine.call(lambda e: e.stages.held()))  # type: ignore[union-attr]


class TestStageFailure:
    async def test_missing_stage_is_a_retryable_error_and_frees_the_head(self, cluster: Cluster, nc: Any,
                                                                         namespace: str) -> None:
        events = await serve(nc, namespace, cluster, "r-gone", ("prefill-nobody",))
        (event,) = events
        assert isinstance(event, ErrorEvent) and event.code is ErrorCode.UNAVAILABLE
        assert not (await cluster.head.engine.call(lambda e: e.stages.held()))  # type: ignore[union-attr]

    async def test_hidden_states_in_another_dtype_are_refused(self, cluster: Cluster, nc: Any, namespace: str) -> None:
        work = StageWork(request_id="r-bad", stages=("x", cluster.tail.instance_id), layer_bounds=(0, 1, 2), stage=1,
                         index=0, start=0, token_ids=(1, 2), prompt_len=2, hidden=b"\0" * 8, dtype="float16",
                         sampling=GREEDY, deadline=time.time() + 10, last=True)
        with pytest.raises(RemoteError) as refused:
            await request(nc, Subjects(namespace).prefill_stage(cluster.tail.instance_id), work, codecs.STAGE_REPLY, 10)
        assert refused.value.reply.code is ErrorCode.BAD_REQUEST


class TestAbandonedStage:
    async def test_a_stage_frees_a_request_whose_head_never_finishes_it(self, cluster: Cluster, nc: Any,
                                                                       namespace: str) -> None:
        tail = cluster.tail
        assert tail.engine is not None
        hidden = b"\0" * (2 * tail.engine.hidden_size * tail.engine.dtype.itemsize)
        work = StageWork(request_id="r-orphan", stages=("x", tail.instance_id), layer_bounds=(0, 2, 4), stage=1,
                         index=0, start=0, token_ids=(1, 2), prompt_len=10, hidden=hidden, dtype="float32",
                         sampling=GREEDY, deadline=time.time() + 1.0)
        done = await request(nc, Subjects(namespace).prefill_stage(tail.instance_id), work, codecs.STAGE_REPLY, 10)
        assert done.index == 0 and done.token_id is None
        assert await tail.engine.call(lambda e: e.stages.held()) == ("r-orphan",)
        deadline = time.monotonic() + 10
        while await tail.engine.call(lambda e: e.stages.held()):  # the head never sends the rest
            assert time.monotonic() < deadline, "the stage kept the request's KV past its deadline"
            await asyncio.sleep(0.1)
