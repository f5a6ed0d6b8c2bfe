"""Soak: steady short-request load against a whole local deployment as `halfmoon up` starts it, the memory
of every process sampled as it goes. Memory must level off after a warm-up and stay inside the bound each
process reports (docs/RELIABILITY.md, "What bounds each process's memory"); a leak shows as a slope after
the warm-up that does not go to zero.

    python -m benchmarks.soak [--minutes 30] [--warmup-minutes 15] [--sample-s 10] [--clients 4] [--out DIR]

Every client loops: a streaming completion of a fresh random prompt, of which one in
``--disconnect-every`` is dropped after its first token. Every ``--sample-s`` seconds each process's RSS,
PSS, private bytes and shared-memory part of RSS are read from /proc (deploy/memory.py). The report gives
per process: RSS at the start, at the end of the warm-up and its peak; its bound; when it levelled off
(the first sample within max(16 MiB, 2%) of its peak); and the least-squares slope of RSS and PSS after
the warm-up, in MiB per hour. It prints the table, and writes it (soak.md), every sample and the summary
(soak.json) and a plot of RSS against time with each bound (soak.png) to ``--out``.

The pool's tiers are `halfmoon up`'s defaults (1 GiB DRAM, 8 GiB NVMe) unless ``--dram-mib`` or
``--nvme-mib`` say otherwise: the DRAM segment is mapped by the engines too, so filling it is most of their
warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from halfmoon.deploy.local import LocalCluster
from halfmoon.deploy.memory import MIB, process_memory
from halfmoon.runtime.memory import MemoryReport

NAMESPACE = "soak"
SERIES = ("rss", "pss", "private", "shmem")
FAILURE_BACKOFF_S = 1.0
LEVEL_TOLERANCE = (16 * MIB, 0.02)  # within this many bytes, or this share, of the peak: levelled off


@dataclass
class Samples:
    """One row per sample: minutes since the load began, requests done, and per process each of ``SERIES`` (MiB)."""

    minutes: list[float] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    memory: dict[str, dict[str, list[float]]] = field(default_factory=dict)


@dataclass(frozen=True)
class ProcessSummary:
    process: str
    start_mib: float
    warm_mib: float
    peak_mib: float
    bound_mib: float | None
    bound_parts: str
    levelled_min: float
    rss_slope_mib_h: float
    pss_slope_mib_h: float
    private_slope_mib_h: float


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else float("nan")


def levelled_off(minutes: list[float], series: list[float]) -> float:
    """When ``series`` (MiB) first came within the tolerance of its peak."""
    peak = max(series)
    tolerance = max(LEVEL_TOLERANCE[0] / MIB, LEVEL_TOLERANCE[1] * peak)
    return next(m for m, v in zip(minutes, series) if v >= peak - tolerance)


def summarise(samples: Samples, bounds: dict[str, MemoryReport], warmup_minutes: float) -> list[ProcessSummary]:
    warm = next((i for i, m in enumerate(samples.minutes) if m >= warmup_minutes - 1e-6), len(samples.minutes) - 1)
    hours = [m / 60 for m in samples.minutes[warm:]]
    rows = []
    for name, series in samples.memory.items():
        rss = series["rss"]
        bound = bounds.get(name)
        rows.append(ProcessSummary(
            process=name, start_mib=rss[0], warm_mib=rss[warm], peak_mib=max(rss),
            bound_mib=bound.total / MIB if bound else None, bound_parts=bound.describe() if bound else "",
            levelled_min=levelled_off(samples.minutes, rss), rss_slope_mib_h=slope(hours, rss[warm:]),
            pss_slope_mib_h=slope(hours, series["pss"][warm:]),
            private_slope_mib_h=slope(hours, series["private"][warm:])))
    return rows


class Load:
    def __init__(self, url: str, model: str, vocab: int, disconnect_every: int, prompt_tokens: int,
                 max_tokens: int) -> None:
        self.url, self.model, self.vocab = url, model, vocab
        self.disconnect_every, self.prompt_tokens, self.max_tokens = disconnect_every, prompt_tokens, max_tokens
        self.done = 0
        self.failed = 0
        self.refusals: collections.Counter[str] = collections.Counter()  # failures by status or error
        self.stop = asyncio.Event()

    async def client(self, seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as http:
            while not self.stop.is_set():
                prompt = [rng.randrange(3, self.vocab) for _ in range(self.prompt_tokens)]
                body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                        "stream": True}
                drop = rng.randrange(self.disconnect_every) == 0
                failure = ""
                try:
                    async with http.stream("POST", "/v1/completions", json=body) as reply:
                        failure = "" if reply.status_code == 200 else str(reply.status_code)
                        async for line in reply.aiter_lines():
                            if drop and line.startswith("data: {"):
                                break
                except httpx.HTTPError as exc:
                    failure = type(exc).__name__
                self.done += not failure
                if failure:
                    self.failed += 1
                    self.refusals[failure] += 1
                    await asyncio.sleep(FAILURE_BACKOFF_S)  # a refused client waits, as a real one would


def sample(cluster: LocalCluster, samples: Samples) -> None:
    for name, pid in cluster.pids().items():
        memory = process_memory(pid)
        if memory is None:  # exited between the two reads; the supervisor's line says so
            continue
        series = samples.memory.setdefault(name, {kind: [] for kind in SERIES})
        for kind in SERIES:
            series[kind].append(getattr(memory, kind) / MIB)


async def soak(cluster: LocalCluster, args: argparse.Namespace, console: Console) -> Samples:
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as http:
        card = (await http.get("/v1/models")).json()["data"][0]
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(cluster.model_dir).vocab_size
    load = Load(cluster.url, card["id"], vocab, args.disconnect_every, args.prompt_tokens, args.max_tokens)
    clients = [asyncio.create_task(load.client(i)) for i in range(args.clients)]
    samples, started = Samples(), time.monotonic()
    try:
        for i in range(int(args.minutes * 60 / args.sample_s) + 1):
            await asyncio.sleep(max(0.0, started + i * args.sample_s - time.monotonic()))
            samples.minutes.append((time.monotonic() - started) / 60)
            samples.requests.append(load.done)
            samples.failed.append(load.failed)
            sample(cluster, samples)
            for line in cluster.supervise():
                console.print(f"[yellow]supervisor[/]: {line}")
            rss = ", ".join(f"{name} {series['rss'][-1]:,.0f}" for name, series in samples.memory.items())
            failed = f"{load.failed} failed: {dict(load.refusals)}" if load.failed else "0 failed"
            console.print(f"{samples.minutes[-1]:5.1f} min: {load.done} requests ({failed}); RSS MiB: {rss}")
    finally:
        load.stop.set()
        await asyncio.gather(*clients, return_exceptions=True)
    return samples


def table(rows: list[ProcessSummary], samples: Samples, args: argparse.Namespace) -> Table:
    warm = next((i for i, m in enumerate(samples.minutes) if m >= args.warmup_minutes - 1e-6), 0)
    span = max(samples.minutes[-1] - samples.minutes[warm], 1e-9)
    rate = (samples.requests[-1] - samples.requests[warm]) / span
    out = Table(title=f"Soak: {args.clients} clients, {args.minutes:g} min ({args.warmup_minutes:g} warm-up), "
                      f"{samples.requests[-1]} requests ({samples.failed[-1]} failed), {rate:.0f} requests/min "
                      "after warm-up")
    for column in ("process", "RSS at start", "after warm-up", "peak", "bound", "peak / bound", "levelled off (min)",
                   "RSS slope (MiB/h)", "PSS slope (MiB/h)", "private slope (MiB/h)"):
        out.add_column(column, justify="right")
    for r in rows:
        share = f"{r.peak_mib / r.bound_mib:.0%}" if r.bound_mib else "-"
        out.add_row(r.process, f"{r.start_mib:,.0f}", f"{r.warm_mib:,.0f}", f"{r.peak_mib:,.0f}",
                    f"{r.bound_mib:,.0f}" if r.bound_mib else "-", share, f"{r.levelled_min:.1f}",
                    f"{r.rss_slope_mib_h:+.1f}", f"{r.pss_slope_mib_h:+.1f}", f"{r.private_slope_mib_h:+.1f}")
    out.caption = "MiB; bounds as `halfmoon up` prints them (runtime/memory.py)"
    return out


def markdown(rendered: Table) -> str:
    """The table as docs/RELIABILITY.md holds it."""
    headers = [str(c.header) for c in rendered.columns]
    cells = [[str(c) for c in column.cells] for column in rendered.columns]
    lines = [f"| {' | '.join(headers)} |", "|---|" + "---:|" * (len(headers) - 1)]
    lines += [f"| {' | '.join(row)} |" for row in zip(*cells)]
    return "\n".join([str(rendered.title), "", *lines, ""])


def plot(samples: Samples, bounds: dict[str, MemoryReport], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    warm = next((i for i, m in enumerate(samples.minutes) if m >= args.warmup_minutes - 1e-6), 0)
    fig, (whole, change) = plt.subplots(2, 1, figsize=(10, 10), sharex=True)
    for i, (name, series) in enumerate(samples.memory.items()):
        colour, rss = f"C{i % 10}", series["rss"]
        minutes = samples.minutes[:len(rss)]
        whole.plot(minutes, rss, color=colour, label=name)
        if name in bounds:
            whole.axhline(bounds[name].total / MIB, color=colour, linestyle=":", linewidth=1)
        if warm < len(rss):  # a flat line after the warm-up is what a process without a leak draws
            change.plot(minutes[warm:], [v - rss[warm] for v in rss[warm:]], color=colour, label=name)
    for ax in (whole, change):
        ax.axvline(args.warmup_minutes, color="grey", linestyle="--", linewidth=1)
    whole.set_ylabel("RSS (MiB, log); dotted: the process's bound")
    whole.set_yscale("log")
    whole.set_title(f"Soak: {args.clients} clients, {samples.requests[-1]} requests; dashed: end of warm-up")
    whole.legend(fontsize="small", loc="lower right")
    change.set_ylabel("RSS change since the warm-up (MiB)")
    change.set_xlabel("minutes under load")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-minutes", type=float, default=15.0, help="long enough to fill the DRAM segment")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between memory samples")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--disconnect-every", type=int, default=4, help="drop one stream in this many early")
    parser.add_argument("--dram-mib", type=int, help="each transfer node's DRAM tier (default: halfmoon up's)")
    parser.add_argument("--nvme-mib", type=int, help="each transfer node's NVMe tier (default: halfmoon up's)")
    parser.add_argument("--model", help="a model directory (default: the tiny random model)")
    parser.add_argument("--out", default="soak-results", help="folder for soak.json, soak.md and soak.png")
    args = parser.parse_args()
    if args.warmup_minutes >= args.minutes:
        parser.error("--warmup-minutes must be shorter than --minutes")
    console = Console(width=180)  # the table whole, in a log too
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from halfmoon.cli.model_tools import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny-llama"))
        env = {}
        if args.dram_mib is not None:
            env["HALFMOON_DRAM_BYTES"] = str(args.dram_mib * MIB)
        if args.nvme_mib is not None:
            env["HALFMOON_NVME_BYTES"] = str(args.nvme_mib * MIB)
        cluster = LocalCluster(model, Path(tmp) / "run", {"prefill": args.prefill, "decode": args.decode},
                               gateway_port=0, namespace=NAMESPACE, env=env, supervised=True,
                               events=lambda line: console.print(f"[yellow]supervisor[/]: {line}"))
        cluster.start(timeout=300)
        try:
            bounds = cluster.memory_bounds()
            samples = asyncio.run(soak(cluster, args, console))
        finally:
            cluster.stop()
    rows = summarise(samples, bounds, args.warmup_minutes)
    rendered = table(rows, samples, args)
    console.print(rendered)
    (out / "soak.md").write_text(markdown(rendered))
    (out / "soak.json").write_text(json.dumps({
        "args": vars(args), "summary": [asdict(r) for r in rows], "samples": asdict(samples),
        "bounds": {name: {"total": b.total, "parts": b.parts} for name, b in bounds.items()}}, indent=1))
    plot(samples, bounds, args, out / "soak.png")
    console.print(f"wrote {out}/soak.md, soak.json and soak.png")


if __name__ == "__main__":
    main()
