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

from rich.console import Console
from rich.progress import track
from rich.table import Table

from benchmarks.inproc import model_or_default, nats_server, timed_request
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.runtime import ServiceHost
from halfmoon.runtime.worker import WorkerConfig
from halfmoon.services.cache_manager.service import (
    CacheManagerConfig,
    CacheManagerService,
)
from halfmoon.services.decode.service import DecodeService
from halfmoon.services.prefill.service import PrefillService
from halfmoon.services.transfer.service import TransferConfig, TransferService

SECRET = "prefix-load-benchmark-0123456789"
TWO_TOKENS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # the second from decode


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

            def draw(n: int) -> list[int]:
                return [rng.randrange(10, 2000) for _ in range(n)]

            out: dict[str, list[float]] = {"whole": [], "layer-wise": [], "cold": [], "whole read": []}
            for i in track(range(2 * rounds + 2), description="cold, then warm (whole / layer-wise)"):
                layerwise = i % 2 == 1
                prefix = draw(prefix_tokens)
                cold, _ = await timed_request(nc, ns, prefill.instance_id, decode.instance_id,
                                              prefix + draw(new_tokens), f"cold-{i}", TWO_TOKENS)
                await until_pooled(prefill, prefix)
                prefill.config = dataclasses.replace(prefill.config, layerwise_prefix=layerwise)
                reads = len(read_s)
                warm, _ = await timed_request(nc, ns, prefill.instance_id, decode.instance_id,
                                              prefix + draw(new_tokens), f"warm-{i}", TWO_TOKENS)
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
