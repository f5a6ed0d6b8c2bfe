"""Fault drills: one process killed (or stopped) at a time under steady streaming load.

    python -m benchmarks.faults [--clients 4] [--max-tokens 48] [--only decode,nats]

Starts a local cluster (2 conductors, 2 prefill, 2 decode, 1 transfer node, the tiny model), and for
each fault prints: requests sent / completed / clear error / lost, in-flight streams migrated, time
from the fault to the first request that started after it and completed, and time until full
strength (the killed process restarted by this script and heartbeating again). The table goes to
docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import httpx

from halfmoon.cli.model_tools import make_tiny_model
from halfmoon.deploy.drills import (
    gateway_counter,
    kill_while_streaming,
    restart,
    restart_nats,
    stopped,
    under_load,
    wait_live,
)
from halfmoon.deploy.local import LocalCluster

API_KEY = "sk-faults-0123456789abcdef"
ENV = {"HALFMOON_HEARTBEAT_INTERVAL_S": "0.25", "HALFMOON_INSTANCE_TIMEOUT_S": "1.5", "HALFMOON_ITL_TIMEOUT_S": "20",
       "HALFMOON_SCHEDULE_TIMEOUT_S": "2", "HALFMOON_STALL_PROBE_S": "1"}


RECOVERY_WAIT_S = 300.0
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class Fault(NamedTuple):
    name: str
    inject: Callable[[LocalCluster], None]
    recover: Callable[[LocalCluster], set[str]]  # restart what was lost; the instances to wait for


def _kill(victim: str, mid_stream: bool = False) -> Fault:
    """``mid_stream``: killed once it streams a token, so it dies holding a request to migrate."""
    inject = (lambda c: kill_while_streaming(c, victim)) if mid_stream else (lambda c: c.kill(victim))
    return Fault(f"SIGKILL {victim}" + (" mid-stream" if mid_stream else ""), inject,
                 lambda c: (restart(c, victim), {victim})[1])


def _stall(c: LocalCluster) -> None:
    with stopped(c, "decode-1"):
        time.sleep(20)


FAULTS = {
    "decode": _kill("decode-0", mid_stream=True),
    "prefill": _kill("prefill-0"),
    "conductor": _kill("conductor-0"),
    "cache-manager": _kill("cache-manager-0"),
    "transfer": _kill("transfer-0"),
    "nats": Fault("NATS down 3 s", lambda c: restart_nats(c, 3.0),
                  lambda c: {f"{r}-{i}" for r in ("prefill", "decode") for i in range(2)}),
    "stall": Fault("SIGSTOP decode-1 20 s", _stall, lambda c: {"decode-1"}),
}


def run_fault(cluster: LocalCluster, model: str, fault: Fault, clients: int, max_tokens: int) -> dict[str, object]:
    migrated = gateway_counter(cluster, "halfmoon_migrations_total")
    outcomes, at = under_load(cluster.url, model, lambda: fault.inject(cluster), clients=clients,
                              max_tokens=max_tokens, after=clients, headers=AUTH)
    migrated = gateway_counter(cluster, "halfmoon_migrations_total") - migrated
    first_ok = min((o.ended for o in outcomes if o.started >= at and o.status == "ok"), default=float("nan"))
    try:
        full = wait_live(cluster, fault.recover(cluster), timeout=RECOVERY_WAIT_S)
    except TimeoutError:  # the restarted process is still loading its engine: say so, drill on
        full = float("inf")
    counts = {s: sum(1 for o in outcomes if o.status == s) for s in ("ok", "error", "lost")}
    return {"fault": fault.name, "sent": len(outcomes), **counts, "migrated": int(migrated),
            "first_ok_s": first_ok - at, "full_s": full - at}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--only", default=",".join(FAULTS), help=f"comma-separated subset of {list(FAULTS)}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="halfmoon-faults-") as tmp:
        model = make_tiny_model(Path(tmp) / "model")
        keys = Path(tmp) / "api-keys"
        keys.write_text(f"{API_KEY} bench\n")
        cluster = LocalCluster(model, Path(tmp) / "run", {"conductor": 2, "prefill": 2, "decode": 2},
                               gateway_port=0, namespace="faults", env={**ENV, "HALFMOON_API_KEYS_FILE": str(keys)})
        cluster.start(timeout=300)
        try:
            name = httpx.get(f"{cluster.url}/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]
            print("| fault | sent | completed | clear error | lost | migrated | first success after (s) "
                  "| full strength after (s) |")
            print("|---|---|---|---|---|---|---|---|")
            for key in args.only.split(","):
                r = run_fault(cluster, name, FAULTS[key], args.clients, args.max_tokens)
                print(f"| {r['fault']} | {r['sent']} | {r['ok']} | {r['error']} | {r['lost']} | {r['migrated']} "
                      f"| {r['first_ok_s']:.1f} | {r['full_s']:.1f} |", flush=True)
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
