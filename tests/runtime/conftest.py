"""The hand-off cluster: real NATS, cache-manager, transfer node (shared memory), prefill and decode services
with the tiny model, in one process so a test can hold one side until the other has done something."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.protocol import codecs
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.stream import TokenEvent
from halfmoon.protocol.subjects import Subjects
from halfmoon.protocol.work import PrefillRequest
from halfmoon.runtime import ServiceHost, request
from halfmoon.runtime.worker import WorkerConfig
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
    nodes: tuple[TransferService, ...]  # ``node`` first


@contextlib.asynccontextmanager
async def running(nats_server, namespace: str, model_dir: Path, layerwise: bool,  # type: ignore[no-untyped-def]
                  num_nodes: int = 1, node_paths: str = "shm,tcp", worker_paths: str = "shm,tcp",
                  **worker_options: Any) -> AsyncIterator[Cluster]:
    common: dict[str, Any] = dict(nats_url=nats_server.url, namespace=namespace, heartbeat_interval_s=0.1,
                                  cluster_secret=SECRET)
    worker = dict(common, model_dir=str(model_dir), kv_cache_bytes=8 << 20, layerwise_handoff=layerwise,
                  dtype="float32", data_paths=worker_paths, **worker_options)  # compared with the float32 engine
    # one process, one event loop: an engine holding it must not cost the pool its only cache-manager (these
    # tests are not about standbys; tests/runtime/test_cache_manager_standby.py is)
    cm = CacheManagerService(CacheManagerConfig(**common, leadership_ttl_s=30.0))
    nodes = tuple(TransferService(TransferConfig(**common, dram_bytes=16 << 20, data_paths=node_paths))
                  for _ in range(num_nodes))
    prefill, decode = PrefillService(WorkerConfig(**worker)), DecodeService(WorkerConfig(**worker))
    async with contextlib.AsyncExitStack() as stack:
        for service in (cm, *nodes, prefill, decode):
            await stack.enter_async_context(ServiceHost(service))
        deadline = time.monotonic() + 30
        # active last: the nodes join the active cache-manager's index once it serves
        while any(node.instance_id not in cm.nodes for node in nodes) or not cm.active or \
                len(prefill.transfer_nodes.ordered()) < num_nodes:
            assert time.monotonic() < deadline, "the transfer nodes never joined an active cache-manager"
            await asyncio.sleep(0.05)
        yield Cluster(cm, nodes[0], prefill, decode, nodes)


@pytest.fixture(params=[True, False], ids=["layerwise", "whole-block"])
async def cluster(request, nats_server, namespace: str, tiny_model_dir: Path) -> AsyncIterator[Cluster]:  # type: ignore[no-untyped-def]
    async with running(nats_server, namespace, tiny_model_dir, request.param) as started:
        yield started


async def serve(nc, namespace: str, cluster: Cluster, rid: str) -> list[int]:  # type: ignore[no-untyped-def]
    subjects, tokens, done = Subjects(namespace), [], asyncio.Event()

    async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
        event = codecs.STREAM.decode(msg.data)
        assert isinstance(event, TokenEvent), event
        tokens.extend(event.token_ids)
        if event.finish_reason is not None:
            done.set()

    sub = await nc.subscribe(subjects.stream("gateway-0", rid), cb=on_event)
    await request(nc, subjects.prefill_submit(cluster.prefill.instance_id, "gateway-0"),
                  PrefillRequest(request_id=rid, prompt_token_ids=tuple(PROMPT), sampling=GREEDY,
                                 decode_instance=cluster.decode.instance_id,
                                 deadline=time.time() + 120), codecs.SUBMIT_REPLY, 10)
    await asyncio.wait_for(done.wait(), 60)
    await sub.unsubscribe()
    return tokens


def count_streamed(cluster: Cluster) -> list[int]:
    """Per hand-off decode receives, how many blocks arrived layer by layer (the rest it reads whole)."""
    receive, counts = cluster.decode.handoff.receive, []

    async def counting_receive(rid: str, kv: Any, streamed: Any = None) -> Any:
        counts.append(len(streamed or {}))
        return await receive(rid, kv, streamed)

    cluster.decode.handoff.receive = counting_receive  # type: ignore[method-assign]
    return counts


@pytest.fixture(scope="session")
def expected(tiny_model_dir: Path) -> list[int]:
    """What the engine alone generates for PROMPT (its exactness against transformers is tests/engine's).
    Computed before any cluster starts: an engine loaded and run in a cluster's event loop stalled it past
    the cache-manager's lease beside a busy loop, and the index it started again missed the blocks put."""
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32")).generate([PROMPT], GREEDY)[0]


async def until(condition, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
