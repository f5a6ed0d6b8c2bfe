"""Cache-manager lookups: 64-block chains, over NATS against the pure index in-process, same run.

    python -m benchmarks.pool_lookup [--chains 200] [--lookups 2000] [--concurrency 16]

Starts a real NATS server, a transfer node and the cache-manager (in this process, each with its own
NATS connection), stores ``--chains`` chains of 64 blocks through put_start/put_end, then times
lookups of whole chains: one at a time for latency (p50/p99) and ``--concurrency`` in flight for
throughput. The baseline is ``PoolIndex.lookup`` called directly on an index holding the same chains.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import subprocess
import tempfile
import time

from rich.console import Console
from rich.table import Table

from halfmoon.core.tiers import Tier
from halfmoon.deploy.processes import free_port, nats_server_binary, wait_for_port
from halfmoon.kv.pool_index import PoolIndex
from halfmoon.kv.pool_types import NodeSpec, PoolConfig
from halfmoon.protocol import codecs
from halfmoon.protocol.cache import Lookup, PutEnd, PutStart
from halfmoon.runtime.host import ServiceHost
from halfmoon.services.cache_manager.service import CacheManagerConfig, CacheManagerService
from halfmoon.services.transfer.service import TransferConfig, TransferService

BLOCK_BYTES = 4096


def chains(count: int) -> list[list[bytes]]:
    return [[hashlib.sha256(f"{c}/{i}".encode()).digest() for i in range(64)] for c in range(count)]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1)))]


def in_process(all_chains: list[list[bytes]], lookups: int) -> float:
    index = PoolIndex(PoolConfig())
    index.add_node(NodeSpec("t0", "127.0.0.1:1", "seg", {Tier.DRAM: 1 << 30}))
    now = time.time()
    for chain in all_chains:
        index.put_start(chain, [BLOCK_BYTES] * len(chain), now)
        index.put_end(chain, now)
    started = time.perf_counter()
    for i in range(lookups):
        result = index.lookup(all_chains[i % len(all_chains)], now)
        index.release(result.lease.lease_id)
    return lookups / (time.perf_counter() - started)


async def over_nats(url: str, all_chains: list[list[bytes]], lookups: int, concurrency: int) -> tuple[list[float], float]:
    common = dict(nats_url=url, namespace="bench", heartbeat_interval_s=0.2)
    async with ServiceHost(TransferService(TransferConfig(**common, instance_id="transfer-0", dram_bytes=1 << 30))), \
            ServiceHost(CacheManagerService(CacheManagerConfig(**common, instance_id="cache-manager-0"))) as host:
        svc = host.service
        while not svc.nodes:  # the manager joins the node at its first heartbeat
            await asyncio.sleep(0.05)
        subject = svc.subjects.cache
        for chain in all_chains:
            await svc.request(subject("put_start"), PutStart(writer="bench", keys=tuple(chain),
                                                             sizes=(BLOCK_BYTES,) * len(chain)),
                              codecs.CACHE_PUT_PLAN, 5)
            await svc.request(subject("put_end"), PutEnd(writer="bench", keys=tuple(chain)), codecs.CACHE_ACK, 5)

        async def lookup(i: int) -> float:
            started = time.perf_counter()
            found = await svc.request(subject("lookup"), Lookup(keys=tuple(all_chains[i % len(all_chains)])),
                                      codecs.CACHE_LOOKUP_RESULT, 5)
            assert len(found.hits) == 64
            return time.perf_counter() - started

        latencies = [await lookup(i) for i in range(lookups // 4)]
        started = time.perf_counter()
        for batch in range(0, lookups, concurrency):
            await asyncio.gather(*[lookup(i) for i in range(batch, min(lookups, batch + concurrency))])
        return latencies, lookups / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chains", type=int, default=200)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    all_chains = chains(args.chains)
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        nats = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", tmp],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port(port, 10, nats)
            latencies, live = asyncio.run(over_nats(f"nats://127.0.0.1:{port}", all_chains, args.lookups,
                                                    args.concurrency))
        finally:
            nats.terminate()
            nats.wait()
    pure = in_process(all_chains, args.lookups)
    table = Table(title=f"cache-manager lookups of 64-block chains ({args.chains} chains stored)")
    for column in ("path", "lookups/s", "p50 ms", "p99 ms", "vs in-process index"):
        table.add_column(column, justify="right")
    table.add_row("PoolIndex.lookup in-process", f"{pure:,.0f}", "", "", "1.00x")
    table.add_row(f"over NATS, {args.concurrency} in flight", f"{live:,.0f}",
                  f"{1000 * statistics.median(latencies):.2f}", f"{1000 * pct(latencies, 0.99):.2f}", f"{live / pure:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
