#!/usr/bin/env python3
"""The whole `docker compose` check, run by infra/compose-check.sh (see there and docs/DEPLOY.md).

Standard library only (python3 >= 3.11, Debian bookworm's), so it needs nothing installed on the host. Steps, each timed:

  engine    a Docker engine: the running one, else (root) install docker.io/docker-compose/debootstrap
            with apt-get if missing and start dockerd; exit 77 (skip) with the reason if none can be had
  images    offline: the debootstrap base image, a wheel directory (host pip, its config and cache),
            then every image with `docker build` (once for all services); online: `compose build`
  up        `up -d --scale prefill=2 --scale decode=2 --scale gateway=2`, polled until every replica
            is running and healthy and the one-shot jobs exited 0
  serve     through nginx: greedy completions equal transformers `generate` (run in the image, on the
            model volume), SSE streaming, `cached_tokens` > 0 on a repeated prefix
  metrics   Prometheus's HTTP API lists every replica of every service as an `up` target
  trace     one request's spans (gateway, conductor, prefill, decode) in the trace backend: the JSONL
            span file on the `traces` volume (offline) or Jaeger (online), read with `halfmoon trace`
  heal      one decode container's process is SIGKILLed from the host while requests go on; the
            restart policy brings it back and requests succeed again
  nats-loss NATS is stopped for good; a Halfmoon service must exit so that its restart policy restarts
            it; NATS comes back and the stack serves again
  down      `down -v`: no container, network or volume of the project is left

The last line printed is a one-line summary; exit 0 only when every step passed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compose_checks import Reference, check_heal, check_metrics, check_nats_loss, check_serve, check_trace
from compose_engine import (
    REPO,
    Failed,
    Skipped,
    build_images,
    compose_command,
    ensure_engine,
    free_port,
    log,
    poll,
    run,
)
from compose_stack import RETRIED, Stack

SKIP = 77


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--online", action="store_true",
                        help="the standard docker-compose.yml with registry images (default: offline build)")
    parser.add_argument("--project", default=os.environ.get("HALFMOON_CHECK_PROJECT", "hmcheck"))
    parser.add_argument("--skip", default=os.environ.get("HALFMOON_CHECK_SKIP", ""),
                        help="comma list of steps to leave out (heal, nats-loss, ...)")
    parser.add_argument("--keep", action="store_true", help="leave the stack running (no `down -v`)")
    parser.add_argument("--up-timeout", type=float, default=float(os.environ.get("HALFMOON_CHECK_UP_TIMEOUT_S", "1200")))
    args = parser.parse_args()
    offline = not args.online
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    state = Path(os.environ.get("HALFMOON_CHECK_STATE", Path.home() / ".cache" / "halfmoon-compose-check"))
    logs = Path(tempfile.mkdtemp(prefix="halfmoon-compose-check-"))
    os.chdir(REPO)
    results: list[tuple[str, str, float, str]] = []
    facts: dict = {}
    t_start = time.monotonic()
    mode = "offline" if offline else "online"

    def step(name: str, fn, *a):  # type: ignore[no-untyped-def]
        if name in skip:
            results.append((name, "skipped", 0.0, "--skip"))
            log(f"step {name}: skipped")
            return None
        log(f"step {name} ...")
        t0 = time.monotonic()
        try:
            try:
                detail = fn(*a)
            except (Failed, Skipped):
                raise
            except Exception as exc:  # any surprise is this step's failure, with its type
                raise Failed(f"{type(exc).__name__}: {exc}") from exc
        except Failed as exc:
            results.append((name, "FAIL", time.monotonic() - t0, str(exc)))
            log(f"step {name}: FAIL after {time.monotonic() - t0:.0f} s: {exc}")
            raise
        results.append((name, "ok", time.monotonic() - t0, detail or ""))
        log(f"step {name}: ok in {time.monotonic() - t0:.0f} s: {detail}")
        return detail

    def summary(verdict: str) -> str:
        steps = " ".join(f"{n}={s}({t:.0f}s)" for n, s, t, _ in results)
        return (f"compose-check: {verdict} ({mode}, {' '.join(compose) if compose else '?'}) {steps} "
                f"retried-429/503={RETRIED['n']} total={time.monotonic() - t_start:.0f}s logs={logs}")

    compose: list[str] = []
    try:
        step("engine", ensure_engine, state, offline)
        compose = compose_command()
        compose_version = run([*compose, "version", "--short"], capture=True, quiet=True, check=False).stdout.strip()
        log(f"compose: {' '.join(compose)} {compose_version}")
    except Skipped as exc:
        print(f"compose-check: SKIP ({exc})", flush=True)
        return SKIP
    except Failed:
        print(summary("FAIL"), flush=True)
        return 1

    image = os.environ.get("HALFMOON_IMAGE", "halfmoon:latest")
    prefix = os.environ.get("HALFMOON_OFFLINE_PREFIX", "halfmoon-offline")
    files = ["-f", "docker-compose.yml"] + (["-f", "infra/compose.offline.yml"] if offline else [])
    env = {**os.environ, "HALFMOON_IMAGE": image, "HALFMOON_OFFLINE_PREFIX": prefix,
           "HALFMOON_GATEWAY_PORT": str(free_port()), "HALFMOON_PROMETHEUS_PORT": str(free_port()),
           "HALFMOON_JAEGER_PORT": str(free_port()), "HALFMOON_GRAFANA_PORT": str(free_port()),
           "OTEL_BSP_SCHEDULE_DELAY": os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "500"),
           # the greedy reference is transformers in float32: the engines must compute in it too
           "HALFMOON_DTYPE": "float32",
           "HALFMOON_HEALTHCHECK_TIMEOUT": os.environ.get("HALFMOON_HEALTHCHECK_TIMEOUT", "10s")}
    stack = Stack(compose, files, args.project, env, offline, logs)
    verdict = "FAIL"
    try:
        if stack.leftovers():
            log(f"removing a previous {args.project} stack")
            stack.down()
        step("images", build_images, offline, image, prefix, compose, files, env, state)
        facts["reference"] = Reference(image, args.project)
        facts["reference"].start()
        step("up", stack.up, args.up_timeout)
        step("serve", check_serve, stack, facts)
        step("metrics", check_metrics, stack)
        step("trace", check_trace, stack, facts)
        step("heal", check_heal, stack, facts)
        step("nats-loss", check_nats_loss, stack, facts)
        verdict = "PASS"
    except (Failed, subprocess.TimeoutExpired) as exc:
        if not results or results[-1][1] != "FAIL":
            results.append(("error", "FAIL", 0.0, str(exc)))
        stack.dump_logs()
    finally:
        stack.dump_logs() if verdict == "PASS" else None
        if not args.keep:
            try:
                step("down", lambda: (stack.down(), poll("nothing left behind", lambda: not stack.leftovers(), 60),
                                      "no container, network or volume left")[-1])
            except (Failed, subprocess.TimeoutExpired):
                verdict = "FAIL"
    for name, status, secs, detail in results:
        log(f"  {name:<9} {status:<7} {secs:6.0f} s  {detail}")
    print(summary(verdict), flush=True)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
