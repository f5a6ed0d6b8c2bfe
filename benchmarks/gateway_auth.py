"""What the gateway's door costs: request latency with no API keys, with a key check (against
``--keys`` keys), and with a key check plus the shared per-tenant rate limit, in the same run.

    python -m benchmarks.gateway_auth [--requests 400] [--keys 100]

One deployment (NATS with per-role users, the conductor, the cache-manager) and two gateways:
one with an API-keys file, one without. There are no engine instances, so every completion is
parsed, tokenised, admitted and scheduled, then refused by the conductor (no prefill
instance, 429 or 503): the latency is the gateway's own path plus one conductor round trip, which the key
check and the rate limit add to. Requests alternate between the three cases, one at a time, so
noise from other work on the machine hits all three alike. The two gateways are separate processes,
so on a busy machine their difference can exceed the door's cost: the door is also timed on its own,
in process (a key check; a rate-limit admission against the live NATS beside a plain NATS round trip).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import nats
from rich.console import Console
from rich.table import Table

from halfmoon.core.tenants import KeyRing, Tenant, bearer_key
from halfmoon.deploy.local import LocalCluster
from halfmoon.deploy.processes import free_port
from halfmoon.deploy.topology import SERVICES
from halfmoon.protocol.permissions import gateway_user
from halfmoon.protocol.subjects import Subjects
from halfmoon.services.gateway.ratelimit import SharedRateLimiter

CASES = ("no keys", "key check", "key check + rate limit")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def keys_file(path: Path, count: int) -> dict[str, str]:
    """``count`` keys: tenant ``open`` (no limits), tenant ``metered`` (limits never reached), the rest filler."""
    keys = {"open": "sk-bench-open-0123456789", "metered": "sk-bench-metered-0123456789"}
    lines = [f"{keys['open']} open", f"{keys['metered']} metered 100000000 1000000000"]
    lines += [f"sk-bench-filler-{i:06d}-abcdef filler-{i}" for i in range(max(0, count - 2))]
    path.write_text("\n".join(lines) + "\n")
    return keys


def start_plain_gateway(cluster: LocalCluster) -> tuple[object, str]:
    import subprocess
    import sys

    spec = next(s for s in SERVICES if s.name == "gateway")
    port = free_port()
    env = cluster.env_for(spec, "gateway-plain")
    env = {k: v for k, v in env.items() if k not in ("HALFMOON_API_KEYS_FILE", "HALFMOON_AUTH_SECRET_FILE")}
    env["HALFMOON_PORT"] = str(port)
    with open(cluster.run_dir / "logs" / "gateway-plain.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", spec.module], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 240
    while time.monotonic() < end and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    tail = (cluster.run_dir / "logs" / "gateway-plain.log").read_text()[-2000:]
    raise TimeoutError(f"the gateway without keys did not come up (exit {proc.poll()}):\n{tail}")


def timed(client: httpx.Client, url: str, headers: dict[str, str], body: dict) -> float:
    start = time.perf_counter()
    reply = client.post(f"{url}/v1/completions", json=body, headers=headers)
    elapsed = time.perf_counter() - start
    # the conductor's "no prefill instance" (429 or 503) means the door let it through
    if reply.status_code not in (429, 503) or reply.json()["error"]["code"] == "rate_limit_exceeded":
        raise RuntimeError(f"expected the conductor's refusal, got {reply.status_code}: {reply.text}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model")
    parser.add_argument("--requests", type=int, default=400, help="per case")
    parser.add_argument("--keys", type=int, default=100, help="keys in the gateway's keys file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from halfmoon.cli.model_tools import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny-llama"))
        keys = keys_file(Path(tmp) / "api-keys", args.keys)
        env = {"HALFMOON_API_KEYS_FILE": str(Path(tmp) / "api-keys")}
        cluster = LocalCluster(model, Path(tmp) / "run", {"prefill": 0, "decode": 0, "transfer": 0},
                               gateway_port=0, namespace="bench", env=env, spare_gateways=("gateway-plain",))
        cluster.start()
        plain, plain_url = start_plain_gateway(cluster)
        try:
            runs = measure(cluster.url, plain_url, keys, args.requests)
            check_us = key_check_us(Path(tmp) / "api-keys", keys["open"])
            admits, flushes = asyncio.run(admission_vs_round_trip(cluster, args.requests))
        finally:
            plain.kill()  # type: ignore[attr-defined]
            cluster.stop()
    report(runs, args)
    Console().print(f"in process: key check {check_us:.1f} us ({args.keys} keys); rate-limit admission "
                    f"p50 {1000 * pct(admits, 0.5):.2f} ms, p99 {1000 * pct(admits, 0.99):.2f} ms against a NATS "
                    f"round trip p50 {1000 * pct(flushes, 0.5):.2f} ms, p99 {1000 * pct(flushes, 0.99):.2f} ms "
                    f"({statistics.median(admits) / statistics.median(flushes):.1f}x)")


def key_check_us(path: Path, key: str, rounds: int = 2000) -> float:
    """Microseconds per key check (header parse, SHA-256, constant-time compare against every key)."""
    ring = KeyRing.load(path)
    header = f"Bearer {key}"
    start = time.perf_counter()
    for _ in range(rounds):
        ring.tenant(bearer_key(header) or "")
    return (time.perf_counter() - start) / rounds * 1e6


async def admission_vs_round_trip(cluster: LocalCluster, rounds: int) -> tuple[list[float], list[float]]:
    """Seconds per rate-limit admission (read + compare-and-set in the shared bucket) and, interleaved,
    per plain NATS round trip (a flush), both over the gateway's own NATS credentials."""
    assert cluster.nats_auth is not None
    nc = await nats.connect(cluster.nats_url, **cluster.nats_auth.connect_options(gateway_user("gateway-0")))
    try:
        limiter = await SharedRateLimiter.open(nc, Subjects(cluster.namespace), time.time)
        tenant = Tenant("bench-direct", 10**9, 10**12)
        admits, flushes = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            await limiter.admit(tenant, 20)
            admits.append(time.perf_counter() - start)
            start = time.perf_counter()
            await nc.flush()
            flushes.append(time.perf_counter() - start)
        return admits, flushes
    finally:
        await nc.close()


def measure(keyed_url: str, plain_url: str, keys: dict[str, str], requests: int) -> dict[str, list[float]]:
    targets = {
        "no keys": (plain_url, {}),
        "key check": (keyed_url, {"Authorization": f"Bearer {keys['open']}"}),
        "key check + rate limit": (keyed_url, {"Authorization": f"Bearer {keys['metered']}"}),
    }
    with httpx.Client(timeout=30) as client:
        model = client.get(f"{keyed_url}/v1/models", headers=targets["key check"][1]).json()["data"][0]["id"]
        body = {"model": model, "prompt": "the door of the gateway", "max_tokens": 4}
        for url, headers in targets.values():  # warm-up: connections, JetStream bucket, tokenizer caches
            for _ in range(20):
                timed(client, url, headers, body)
        runs: dict[str, list[float]] = {case: [] for case in CASES}
        for _ in range(requests):
            for case in CASES:
                runs[case].append(timed(client, *targets[case], body))
    return runs


def report(runs: dict[str, list[float]], args: argparse.Namespace) -> None:
    table = Table(title=f"Gateway door ({args.requests} requests per case, {args.keys} keys, "
                        f"{os.cpu_count()} cores, interleaved)")
    for column in ("case", "p50 ms", "p99 ms", "mean ms", "p50 added ms", "mean / no keys"):
        table.add_column(column, justify="right")
    base = runs["no keys"]
    for case in CASES:
        values = runs[case]
        table.add_row(case, f"{1000 * pct(values, 0.5):.2f}", f"{1000 * pct(values, 0.99):.2f}",
                      f"{1000 * statistics.mean(values):.2f}", f"{1000 * (pct(values, 0.5) - pct(base, 0.5)):+.2f}",
                      f"{statistics.mean(values) / statistics.mean(base):.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
