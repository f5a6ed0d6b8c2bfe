"""TTFT with a prefix from the pool: read whole before the compute vs layer by layer during it.

    python -m benchmarks.prefix_load [--model DIR] [--prefix-tokens 1920] [--new-tokens 128] [--rounds 5]

One process runs a real NATS server, the cache-manager, a transfer node (shared memory), a prefill
instance without a local prefix cache (so a warm prefix can only come from the pool) and a decode
instance. Each round first sends a cold request (a new prefix: computed, then stored in the pool),
then a warm one with the same prefix and a new suffix; warm requests alternate the prefill's
``layerwise_prefix`` so both modes share the machine's noise. TTFT is from the submit to the first
token's stream event, as a client of prefill sees it. Also shown: how long the whole read took
(lookup excluded), the part a layer-wise load can hide behind the compute.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import tempfile
import time
from typing import Any

from halfmoon.protocol import codecs
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.subjects import Subjects
from halfmoon.protocol.work import PrefillRequest
from halfmoon.service import ServiceHost, request
from halfmoon.service.worker import WorkerConfig
from halfmoon.services.cache_manager.service import CacheManagerConfig, CacheManagerService
from halfmoon.services.decode.service import DecodeService
from halfmoon.services.prefill.service import PrefillService
from halfmoon.services.transfer.service import TransferConfig, TransferService
from rich.console import Console
from rich.progress import track
from rich.table import Table

from benchmarks.inproc import model_or_default, nats_server

SECRET = "prefix-load-benchmark-0123456789"
TWO_TOKENS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # the second from decode


async def ttft(nc: Any, ns: str, prefill: PrefillService, decode: DecodeService, prompt: list[int], rid: str) -> float:
    """Time to the first token; returns once the request is done."""
    subjects, first, done = Subjects(ns), asyncio.Event(), asyncio.Event()

    async def on_event(msg: Any) -> None:
        first.set()
        if getattr(codecs.STREAM.decode(msg.data), "finish_reason", None) is not None:
            done.set()

    sub = await nc.subscribe(subjects.stream(rid), cb=on_event)
    start = time.perf_counter()
    await request(nc, subjects.prefill_submit(prefill.instance_id),
                  PrefillRequest(request_id=rid, prompt_token_ids=tuple(prompt), sampling=TWO_TOKENS,
                                 decode_instance=decode.instance_id, stream_subject=subjects.stream(rid),
                                 deadline=time.time() + 300), codecs.SUBMIT_REPLY, 30)
    await asyncio.wait_for(first.wait(), 300)
    elapsed = time.perf_counter() - start
    await asyncio.wait_for(done.wait(), 300)
    await sub.unsubscribe()
    return elapsed


async def until_pooled(prefill: PrefillService, prefix: list[int]) -> None:
    """Until the pool holds every full block of ``prefix`` (the cold request commits them after its hand-off)."""
    assert prefill.engine is not None
    keys = prefill.engine.kv_spec.hasher(None).keys(prefix)[: len(prefix) // prefill.config.block_size]
    deadline = time.monotonic() + 60
    while True:
        found = await prefill.pool.lookup(keys)
        if found is not None:
            await prefill.pool.release(found.lease_id)
            if len(found.hits) == len(keys):
                return
        assert time.monotonic() < deadline, "the cold request's blocks never reached the pool"
        await asyncio.sleep(0.02)


async def run(model: str, prefix_tokens: int, new_tokens: int, rounds: int) -> dict[str, list[float]]:
    import nats

    with nats_server() as url:
        ns = "bench"
        common: dict[str, Any] = dict(nats_url=url, namespace=ns, heartbeat_interval_s=0.2, cluster_secret=SECRET)
        worker = dict(common, model_dir=model, kv_cache_bytes=512 << 20, max_num_batched_tokens=8192,
                      prefill_chunk_size=8192, local_prefix_cache=False)
        cm = CacheManagerService(CacheManagerConfig(**common))
        node = TransferService(TransferConfig(**common, dram_bytes=2 << 30))
        prefill, decode = PrefillService(WorkerConfig(**worker)), DecodeService(WorkerConfig(**worker))
        async with ServiceHost(cm), ServiceHost(node), ServiceHost(prefill), ServiceHost(decode):
            while node.instance_id not in cm.nodes or not prefill.transfer_nodes.ordered():
                await asyncio.sleep(0.05)
            read_s: list[float] = []
            read_prefix = prefill.pool.read_prefix

            async def timed_read(found: Any) -> Any:
                began = time.perf_counter()
                out = await read_prefix(found)
                read_s.append(time.perf_counter() - began)
                return out

            prefill.pool.read_prefix = timed_read  # type: ignore[method-assign]
            nc = await nats.connect(url)
            rng = random.Random(0)
            draw = lambda n: [rng.randrange(10, 2000) for _ in range(n)]  # noqa: E731
            out: dict[str, list[float]] = {"whole": [], "layer-wise": [], "cold": [], "whole read": []}
            for i in track(range(2 * rounds + 2), description="cold, then warm (whole / layer-wise)"):
                layerwise = i % 2 == 1
                prefix = draw(prefix_tokens)
                cold = await ttft(nc, ns, prefill, decode, prefix + draw(new_tokens), f"cold-{i}")
                await until_pooled(prefill, prefix)
                prefill.config = dataclasses.replace(prefill.config, layerwise_prefix=layerwise)
                reads = len(read_s)
                warm = await ttft(nc, ns, prefill, decode, prefix + draw(new_tokens), f"warm-{i}")
                assert (len(read_s) == reads) == layerwise, "the warm prefix did not load as configured"
                if i >= 2:  # the first pair warms up
                    out["cold"].append(cold)
                    out["layer-wise" if layerwise else "whole"].append(warm)
                    if not layerwise:
                        out["whole read"].append(read_s[-1])
            await nc.close()
            return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="model directory (default: a random-initialised 16-layer model)")
    parser.add_argument("--prefix-tokens", type=int, default=1920)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = model_or_default(args.model, tmp)
        out = asyncio.run(run(model, args.prefix_tokens, args.new_tokens, args.rounds))
    ms = {name: statistics.median(values) * 1e3 for name, values in out.items()}
    table = Table(title=f"TTFT at prefill, {args.prefix_tokens}-token prefix from the pool + {args.new_tokens} new "
                        f"tokens, {args.rounds} rounds each (median ms)")
    for column in ("cold", "warm, whole read", "warm, layer-wise", "layer-wise / whole", "whole read alone"):
        table.add_column(column, justify="right")
    table.add_row(f"{ms['cold']:.1f}", f"{ms['whole']:.1f}", f"{ms['layer-wise']:.1f}",
                  f"{ms['layer-wise'] / ms['whole']:.2f}", f"{ms['whole read']:.1f}")
    Console().print({name: [round(v * 1e3, 1) for v in values] for name, values in out.items()})
    Console().print(table)


if __name__ == "__main__":
    main()
