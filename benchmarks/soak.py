"""Soak: steady load against a whole local deployment, the resident memory of every process sampled
as it goes, and the slope of each after a warm-up. A leak shows as a slope that does not level off.

    python -m benchmarks.soak --minutes 10 [--warmup-minutes 2] [--clients 4] [--prefill 2 --decode 2]

Every client loops: a streaming completion of a fresh random prompt, of which one in
``--disconnect-every`` is dropped after its first token (the path that used to leak). The baseline
of each process is its RSS at the end of the warm-up; the table gives that, the last sample, and the
least-squares slope of the samples after the warm-up, per minute and per 1,000 requests. The pool's
tiers are small (``--dram-mib``, ``--nvme-mib``) so that it is full before the warm-up ends: the
cache-manager's index grows with the blocks held (~600 bytes each) until the tiers are full, as it should.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import nats
import psutil
from rich.console import Console
from rich.table import Table

from halfmoon.deploy.drills import operator_nats
from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol import codecs
from halfmoon.protocol.pool import StatsRequest
from halfmoon.protocol.subjects import Subjects
from halfmoon.runtime import request

NAMESPACE = "soak"
MIB = 1 << 20


@dataclass
class Samples:
    """One row per sample: minutes since start, requests done, RSS per process, pool blocks indexed."""

    minutes: list[float] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    rss: dict[str, list[float]] = field(default_factory=dict)
    pool_blocks: list[int] = field(default_factory=list)


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else float("nan")


class Load:
    def __init__(self, url: str, model: str, vocab: int, disconnect_every: int, prompt_tokens: int,
                 max_tokens: int) -> None:
        self.url, self.model, self.vocab = url, model, vocab
        self.disconnect_every, self.prompt_tokens, self.max_tokens = disconnect_every, prompt_tokens, max_tokens
        self.done = 0
        self.failed = 0
        self.stop = asyncio.Event()

    async def client(self, seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as http:
            while not self.stop.is_set():
                prompt = [rng.randrange(3, self.vocab) for _ in range(self.prompt_tokens)]
                body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                        "stream": True}
                drop = rng.randrange(self.disconnect_every) == 0
                try:
                    async with http.stream("POST", "/v1/completions", json=body) as reply:
                        ok = reply.status_code == 200
                        async for line in reply.aiter_lines():
                            if drop and line.startswith("data: {"):
                                break
                except httpx.HTTPError:
                    ok = False
                self.done += ok
                self.failed += not ok


def processes(cluster: LocalCluster) -> dict[str, psutil.Process]:
    return {name: psutil.Process(pid) for name, pid in cluster.pids().items()}


async def pool_blocks(nc: nats.NATS) -> int:
    reply = await request(nc, Subjects(NAMESPACE).cache("stats"), StatsRequest(), codecs.CACHE_STATS, 10)
    return reply.blocks


async def soak(cluster: LocalCluster, args: argparse.Namespace, console: Console) -> Samples:
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as http:
        card = (await http.get("/v1/models")).json()["data"][0]
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(cluster.model_dir).vocab_size
    load = Load(cluster.url, card["id"], vocab, args.disconnect_every, args.prompt_tokens, args.max_tokens)
    clients = [asyncio.create_task(load.client(i)) for i in range(args.clients)]
    nc = await operator_nats(cluster)
    samples, started = Samples(), time.monotonic()
    try:
        for i in range(int(args.minutes * 60 / args.sample_s) + 1):
            await asyncio.sleep(max(0.0, started + i * args.sample_s - time.monotonic()))
            samples.minutes.append((time.monotonic() - started) / 60)
            samples.requests.append(load.done)
            for name, proc in processes(cluster).items():
                samples.rss.setdefault(name, []).append(proc.memory_info().rss / MIB)
            samples.pool_blocks.append(await pool_blocks(nc))
            console.print(f"{samples.minutes[-1]:5.1f} min: {load.done} requests ({load.failed} failed), "
                          f"cache-manager {samples.rss['cache-manager-0'][-1]:.1f} MiB, "
                          f"{samples.pool_blocks[-1]} pool blocks")
    finally:
        load.stop.set()
        await asyncio.gather(*clients, return_exceptions=True)
        await nc.close()
    return samples


def report(samples: Samples, args: argparse.Namespace) -> Table:
    warm = next((i for i, m in enumerate(samples.minutes) if m >= args.warmup_minutes - 1e-6), 0)
    minutes, done = samples.minutes[warm:], samples.requests[warm:]
    rate = (done[-1] - done[0]) / max(minutes[-1] - minutes[0], 1e-9)
    table = Table(title=f"Soak: {args.clients} clients, {args.minutes:g} min ({args.warmup_minutes:g} warm-up), "
                        f"{samples.requests[-1]} requests, {rate:.0f} requests/min after warm-up")
    for column in ("process", "RSS after warm-up (MiB)", "RSS at end (MiB)", "change", "slope (MiB/min)",
                   "slope (MiB/1k requests)"):
        table.add_column(column, justify="right")
    for name, series in samples.rss.items():
        after = series[warm:]
        per_min = slope(minutes, after)
        table.add_row(name, f"{after[0]:.1f}", f"{after[-1]:.1f}", f"{after[-1] / after[0]:.3f}x",
                      f"{per_min:+.2f}", f"{1000 * per_min / rate:+.2f}" if rate else "-")
    blocks = samples.pool_blocks[warm:]
    table.caption = (f"pool blocks indexed: {blocks[0]} after warm-up, {blocks[-1]} at end "
                     f"({slope(minutes, [float(b) for b in blocks]):+.0f}/min)")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-minutes", type=float, default=2.0)
    parser.add_argument("--sample-s", type=float, default=60.0, help="seconds between RSS samples")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--disconnect-every", type=int, default=4, help="drop one stream in this many early")
    parser.add_argument("--dram-mib", type=int, default=64, help="each transfer node's DRAM tier")
    parser.add_argument("--nvme-mib", type=int, default=128, help="each transfer node's NVMe tier")
    parser.add_argument("--model")
    args = parser.parse_args()
    if args.warmup_minutes >= args.minutes:
        parser.error("--warmup-minutes must be shorter than --minutes")
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from halfmoon.cli.model_tools import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny-llama"))
        # Small tiers, so the pool is full within the warm-up: from then on its index must stay flat.
        env = {"HALFMOON_DRAM_BYTES": str(args.dram_mib << 20), "HALFMOON_NVME_BYTES": str(args.nvme_mib << 20)}
        cluster = LocalCluster(model, Path(tmp) / "run", {"prefill": args.prefill, "decode": args.decode},
                               gateway_port=0, namespace=NAMESPACE, env=env)
        cluster.start(timeout=300)
        try:
            samples = asyncio.run(soak(cluster, args, console))
        finally:
            cluster.stop()
    console.print(report(samples, args))


if __name__ == "__main__":
    main()
