"""Run a whole deployment as local processes: NATS from its wheel, then every service."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import nats
from nats.aio.msg import Msg

from halfmoon.core.cluster_keys import new_secret
from halfmoon.deploy.jetstream import LEADERSHIP_TTL_S, create_buckets
from halfmoon.deploy.nats_auth import NatsAuth, embedded_server_config
from halfmoon.deploy.processes import SOURCE_ROOTS, core_share, log_tail, nats_server_binary, wait_for_port
from halfmoon.deploy.supervisor import CrashLoop, RestartPolicy, Supervision
from halfmoon.deploy.topology import ENGINE_SERVICES, OPTIONAL_SERVICES, SERVICES, ServiceSpec, instances
from halfmoon.protocol import codecs
from halfmoon.protocol.permissions import nats_user
from halfmoon.protocol.registry import KernelReport, Leaving, Role
from halfmoon.protocol.subjects import Subjects
from halfmoon.runtime.memory import MemoryReport, deployment_bounds

DEFAULT_POLICY = RestartPolicy()


# What env_for sets for each instance (``env`` may override them, as tests do; `halfmoon up` keeps a user's
# value of these out, which would give every instance the same one).
PER_INSTANCE_SETTINGS = frozenset(f"HALFMOON_{name}" for name in (
    "INSTANCE_ID", "READY_FILE", "METRICS_PORT", "METRICS_HOST", "PORT", "NVME_DIR", "TRACE_FILE", "NATS_URL",
    "NAMESPACE", "MODEL_DIR", "CLUSTER_SECRET"))


class LocalCluster:
    """Contract: ``start`` returns once every instance heartbeats and, where the plan can serve, the
    gateway's ``/ready`` says a request would be placed (or raises, leaving nothing running); ``stop``
    sends SIGTERM to all, waits for their drain, then kills what is left.
    ``supervise`` (called every second or so by ``halfmoon up``) restarts what exited, NATS included,
    with the same instance id after a backoff; one that exits too often (crash-looping) backs off for
    minutes, reported, while the others serve on. With ``supervised`` the same happens while ``start``
    waits, except that a crash loop there raises :class:`CrashLoop` naming the process.
    Every process binds its ports itself (port 0) and reports them: NATS in a ports file, services
    in ``run_dir/ready/<instance>.json``. Logs go to ``run_dir/logs/<instance>.log``, spans to
    ``run_dir/traces.jsonl``; ``events`` gets one line per exit and restart."""

    def __init__(self, model_dir: str | Path, run_dir: str | Path, counts: dict[str, int] | None = None, *,
                 nats_url: str | None = None, namespace: str = "halfmoon", gateway_port: int = 8000,
                 env: dict[str, str] | None = None, metrics: bool = False, supervised: bool = False,
                 policy: RestartPolicy = DEFAULT_POLICY, events: Callable[[str], None] = lambda _m: None,
                 spare_gateways: tuple[str, ...] = (), engine_python: str | None = None) -> None:
        self.model_dir = str(model_dir)
        self.run_dir = Path(run_dir).resolve()  # services run from the repository root
        self.plan = instances(counts or {})
        self.spare_gateways = spare_gateways  # ids with NATS users for gateways started beside the plan's
        # the engines' interpreter: one with vLLM where they run it (HALFMOON_ENGINE=vllm) and this one has not
        self.engine_python = engine_python or sys.executable
        self.specs = {iid: spec for spec, iid in self.plan}
        self.nats_url = nats_url
        self.namespace = namespace
        self.gateway_port = gateway_port  # 0: whatever the gateway binds, kept across its restarts
        self.extra_env = env or {}
        self.cluster_secret = new_secret()  # one per run, for every service's data-plane keys
        self.metrics = metrics
        self.supervised = supervised
        self.events = events
        self.supervision = Supervision(policy)
        self.metrics_ports: dict[str, int] = {}
        self.kernels: dict[str, KernelReport] = {}  # each engine instance's, from its heartbeats
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._coming_up: set[str] = set()  # restarted, not yet serving
        self._nats: subprocess.Popen[bytes] | None = None
        self.nats_auth: NatsAuth | None = None  # per-role credentials of the NATS server started here
        self._nats_port = 0
        self._nats_config = Path()
        self._starting = False  # ``start`` is waiting for the deployment: a crash loop there fails it

    @property
    def gateways(self) -> list[str]:
        """The gateway instance ids that get NATS users: the plan's and the spare ones."""
        return [*(iid for spec, iid in self.plan if spec.name == Role.GATEWAY.value), *self.spare_gateways]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def metrics_urls(self) -> dict[str, str]:
        urls = {iid: f"http://127.0.0.1:{port}/metrics" for iid, port in self.metrics_ports.items()}
        gateway = {"gateway-0": f"{self.url}/metrics"} if "gateway-0" in self.specs else {}
        return {**gateway, **urls} if self.metrics else {}

    @property
    def trace_file(self) -> Path:
        return self.run_dir / "traces.jsonl"

    def ready_file(self, instance_id: str) -> Path:
        return self.run_dir / "ready" / f"{instance_id}.json"

    def log_file(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def env_for(self, spec: ServiceSpec, instance_id: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HALFMOON_")}
        env["PYTHONPATH"] = os.pathsep.join((*SOURCE_ROOTS, env.get("PYTHONPATH", "")))
        env.update(HALFMOON_NATS_URL=self.nats_url or "", HALFMOON_NAMESPACE=self.namespace,
                   HALFMOON_INSTANCE_ID=instance_id, HALFMOON_MODEL_DIR=self.model_dir,
                   HALFMOON_TRACE_FILE=str(self.trace_file), HALFMOON_LOG_FORMAT="text",
                   HALFMOON_CLUSTER_SECRET=self.cluster_secret,
                   HALFMOON_READY_FILE=str(self.ready_file(instance_id)))
        if self.nats_auth is not None:
            env.update(self.nats_auth.env(nats_user(spec.name, instance_id)))
        if spec.name == "gateway":
            env["HALFMOON_PORT"] = str(self.gateway_port)
        if spec.name == "transfer":
            env["HALFMOON_NVME_DIR"] = str(self.run_dir / "nvme" / instance_id)
        if spec.name in ENGINE_SERVICES and "OMP_NUM_THREADS" not in os.environ:
            # One machine, several engines: more torch threads than cores makes every engine crawl.
            engines = sum(1 for s, _ in self.plan if s.name in ENGINE_SERVICES)
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // engines))
        if spec.name in ENGINE_SERVICES and "OMP_WAIT_POLICY" not in os.environ:
            # OpenMP's default spins idle threads for a while after every parallel region; with anything
            # else on the cores (a load generator, a sidecar), the spinning threads and the neighbour take
            # turns and a step ran 13x slower under aiperf (BENCHMARKS, "How does halfmoon up compare
            # with vLLM?"). Passive threads sleep instead.
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        engine_ids = [iid for s, iid in self.plan if s.name in ENGINE_SERVICES]
        vllm = {**os.environ, **self.extra_env}.get("HALFMOON_ENGINE") == "vllm"
        if vllm and instance_id in engine_ids and len(engine_ids) > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vLLM binds its OpenMP threads to the node's cores itself, every engine to the same ones: give
            # each engine its own share instead
            env["VLLM_CPU_OMP_THREADS_BIND"] = core_share(engine_ids.index(instance_id), len(engine_ids),
                                                          os.cpu_count() or 1)
        if self.metrics and spec.name != "gateway":  # the gateway serves /metrics on its API port
            env.update(HALFMOON_METRICS_PORT="-1", HALFMOON_METRICS_HOST="127.0.0.1")  # -1: any free port
        env.update(self.extra_env)
        return env

    def start(self, timeout: float = 180.0, progress: Callable[[str], None] = lambda _m: None) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        try:
            if self.nats_url is None:
                self._start_nats(timeout=15)
                self.nats_url = f"nats://127.0.0.1:{self._nats_port}"
                progress(f"NATS on {self.nats_url}")
            asyncio.run(self._create_jetstream())
            for spec, instance_id in self.plan:
                self.start_instance(spec, instance_id)
            self._starting = True
            asyncio.run(self._wait_ready({iid for _, iid in self.plan}, timeout, progress))
        except BaseException:
            self.stop()
            raise
        finally:
            self._starting = False

    def _start_nats(self, timeout: float) -> None:
        """First start: port 0 (``-p -1``), read back from its ports file; a restart takes the same port."""
        ports_dir = self.run_dir / "nats-ports"
        shutil.rmtree(ports_dir, ignore_errors=True)
        ports_dir.mkdir(parents=True)
        # NOTE: a gateway's user is scoped to its instance id, which its restarts keep
        self.nats_auth, self._nats_config = embedded_server_config(self.run_dir, self.namespace, -1, self.gateways)
        self.respawn_nats("--ports_file_dir", str(ports_dir))
        assert self._nats is not None
        end = time.monotonic() + timeout
        while not (found := list(ports_dir.glob("*.ports"))):
            if self._nats.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self._nats.returncode}; see {self.log_file('nats')}")
            if time.monotonic() > end:
                raise TimeoutError(f"nats-server wrote no ports file within {timeout}s")
            time.sleep(0.05)
        url = json.loads(found[0].read_text())["nats"][0]
        self._nats_port = int(url.rsplit(":", 1)[1])
        wait_for_port(self._nats_port, timeout, self._nats)

    def respawn_nats(self, *extra: str) -> None:
        """Start the cluster's NATS server (again) with its config, on its port once it has one."""
        with open(self.log_file("nats"), "ab") as log:
            self._nats = subprocess.Popen(
                # the config holds the users, permissions and JetStream's store dir; the port is ours to choose
                [nats_server_binary(), "-c", str(self._nats_config), "-a", "127.0.0.1", "-p",
                 str(self._nats_port or -1), *extra],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.supervision.started("nats", time.monotonic())

    def start_instance(self, spec: ServiceSpec, instance_id: str) -> subprocess.Popen[bytes]:
        self.ready_file(instance_id).unlink(missing_ok=True)
        with open(self.log_file(instance_id), "ab") as log:
            python = self.engine_python if spec.name in ENGINE_SERVICES else sys.executable
            proc = subprocess.Popen([python, "-m", spec.module], env=self.env_for(spec, instance_id),
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[instance_id] = proc
        self.supervision.started(instance_id, time.monotonic())
        return proc

    def members(self, name: str) -> list[str]:
        """The instances of service ``name`` the deployment runs: up, starting or restarting, not retired."""
        return [iid for spec, iid in self.plan if spec.name == name]

    def add_instance(self, name: str) -> str:
        """Start one more instance of service ``name`` under an id no earlier instance of this run had (a
        retired one may still be draining under its old id); ``supervise`` reports when it serves."""
        spec = next(s for s in (*SERVICES, *OPTIONAL_SERVICES) if s.name == name)
        used = [int(iid.rsplit("-", 1)[1]) for iid, s in self.specs.items() if s.name == name]
        instance_id = f"{name}-{max(used, default=-1) + 1}"
        self.plan.append((spec, instance_id))
        self.specs[instance_id] = spec
        self.start_instance(spec, instance_id)
        self._coming_up.add(instance_id)
        return instance_id

    def retire_instance(self, instance_id: str) -> None:
        """Drain one instance out of the deployment: SIGTERM, after which it takes no new work, finishes
        what it holds and exits (runtime/host.py); it is leaving as draining, so nothing restarts it."""
        self.supervision.stopping(instance_id)
        self.plan = [(spec, iid) for spec, iid in self.plan if iid != instance_id]
        self._coming_up.discard(instance_id)
        proc = self.procs[instance_id]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    @property
    def can_serve(self) -> bool:
        """The plan has a gateway, a conductor and engines for both phases (prefill and decode, or aggregated)."""
        names = {spec.name for spec, _ in self.plan}
        return {"gateway", "conductor"} <= names and ({"prefill", "decode"} <= names or "aggregated" in names)

    def read_ready(self, instance_id: str) -> dict | None:
        """What the instance reported once serving (pid, ports), or None while it is not up."""
        try:
            info = json.loads(self.ready_file(instance_id).read_text())
        except (OSError, ValueError):
            return None
        if info.get("pid") != self.procs[instance_id].pid:
            return None  # left by an earlier run of this instance
        if info.get("metrics_port"):
            self.metrics_ports[instance_id] = info["metrics_port"]
        if instance_id == "gateway-0" and info.get("address"):
            self.gateway_port = int(str(info["address"]).rsplit(":", 1)[1])  # restarts keep this port
        return info

    def supervise(self) -> list[str]:
        """Restart what exited (after its backoff) unless it is leaving as draining; returns what happened.
        Raises CrashLoop for a process crash-looping while ``start`` waits."""
        now = time.monotonic()
        happened = [*self._schedule_restarts(now), *self._restart_due(now), *self._now_serving()]
        for line in happened:
            self.events(line)
        return happened

    def _exited(self) -> list[tuple[str, int]]:
        """The processes, NATS included, that exited and are not yet waiting for their restart, with their codes."""
        watched = {**self.procs, "nats": self._nats} if self._nats is not None else self.procs
        return [(name, proc.returncode) for name, proc in watched.items()
                if not self.supervision.awaiting_restart(name) and proc.poll() is not None]

    def _schedule_restarts(self, now: float) -> list[str]:
        """Every process that exited, but one leaving as draining, waits out its backoff: a line for each."""
        happened = []
        for name, code in self._exited():
            if self.supervision.leaving(name, now) is Leaving.DRAINING:
                continue
            delay = self.supervision.exited(name, now)
            if self.supervision.leaving(name, now) is Leaving.CRASH_LOOPING:
                happened.append(self._report_crash_loop(name, delay))
            else:
                happened.append(f"{name} exited with {code}; restarting in {delay:g}s")
        return happened

    def _report_crash_loop(self, name: str, delay: float) -> str:
        """Its line, with the process's last log lines; while ``start`` waits, the start fails instead."""
        policy = self.supervision.policy
        loop = CrashLoop(name, policy.crash_loop_exits, policy.crash_loop_window_s, log_tail(self.log_file(name)))
        if self._starting:
            raise loop  # never came up: the start fails, naming it
        # NOTE: one instance that keeps failing must not take the others down: it backs off, reported
        return f"{loop}\n  backing off: restarting {name} in {delay:g}s; the others serve on"

    def _restart_due(self, now: float) -> list[str]:
        happened = []
        for name in self.supervision.due(now):
            if name == "nats":
                self.respawn_nats()  # same port: every service reconnects to the URL it knows
            else:
                self.start_instance(self.specs[name], name)
                self._coming_up.add(name)
            happened.append(f"{name} restarted (restart {self.supervision.restarts(name)})")
        return happened

    def _now_serving(self) -> list[str]:
        """Those restarted or added that have come up since the last look."""
        happened = []
        for name in list(self._coming_up):
            if self.read_ready(name) is not None:
                self._coming_up.discard(name)
                port = self.metrics_ports.get(name)
                again = " again" if self.supervision.restarts(name) else ""  # else added by scale_to
                happened.append(f"{name} serving{again} (pid {self.procs[name].pid}"
                                + (f", metrics at http://127.0.0.1:{port}/metrics)" if port else ")"))
        return happened

    async def _create_jetstream(self) -> None:
        """As the operator: the buckets services use but may not create (halfmoon.deploy.jetstream)."""
        options = self.nats_auth.connect_options() if self.nats_auth is not None else {}
        assert self.nats_url is not None  # start() has set it by now
        nc = await nats.connect(self.nats_url, connect_timeout=5, **options)
        try:
            # the lease must lapse in the time the cache-managers assume (they run with this environment)
            ttl = float(self.extra_env.get("HALFMOON_LEADERSHIP_TTL_S", LEADERSHIP_TTL_S))
            await create_buckets(nc, self.namespace, ttl)
        finally:
            await nc.close()

    async def _wait_ready(self, expected: set[str], timeout: float, progress: Callable[[str], None]) -> None:
        subjects = Subjects(self.namespace)
        options = self.nats_auth.connect_options() if self.nats_auth is not None else {}
        assert self.nats_url is not None  # start() has set it by now
        nc = await nats.connect(self.nats_url, connect_timeout=5, max_reconnect_attempts=-1, **options)
        seen: set[str] = set()

        async def on_heartbeat(msg: Msg) -> None:
            beat = codecs.HEARTBEAT.decode(msg.data)
            if beat.kernels is not None:
                self.kernels[beat.instance_id] = beat.kernels
            if beat.instance_id in expected and beat.instance_id not in seen and self.read_ready(beat.instance_id):
                seen.add(beat.instance_id)
                progress(f"{beat.instance_id} up ({len(seen)}/{len(expected)})")

        await nc.subscribe(subjects.heartbeat, cb=on_heartbeat)
        serving = not self.can_serve
        try:
            end = time.monotonic() + timeout
            while seen != expected or not serving:
                if seen == expected and not serving:
                    # NOTE: every process up is not yet a deployment that serves: the conductor may not know the
                    # engines yet; its answer through the gateway is what a client's first request gets
                    serving = await self._gateway_ready()
                    if serving:
                        progress("ready to serve")
                if self.supervised:
                    for line in self.supervise():
                        progress(line)
                else:
                    dead = [iid for iid, p in self.procs.items() if p.poll() is not None]
                    if dead:
                        raise RuntimeError(f"{', '.join(dead)} exited during start; see {self.run_dir / 'logs'}")
                if time.monotonic() > end:
                    missing = sorted(expected - seen) or [f"{self.url}/ready"]
                    raise TimeoutError(f"not up after {timeout}s: {missing}")
                await asyncio.sleep(0.2)
        finally:
            await nc.close()

    async def _gateway_ready(self) -> bool:
        try:
            async with httpx.AsyncClient(timeout=5) as http:
                return (await http.get(f"{self.url}/ready")).status_code == 200
        except httpx.HTTPError:
            return False

    def memory_bounds(self) -> dict[str, MemoryReport]:
        """What bounds each serving instance's resident memory: the reports in their ready files, with what
        the deployment adds (runtime/memory.py). NATS, not ours, has none."""
        reports = {}
        for instance_id in self.procs:
            info = self.read_ready(instance_id)
            if info is not None and info.get("memory"):
                reports[instance_id] = msgspec.convert(info["memory"], MemoryReport)
        return deployment_bounds(reports)

    def pids(self) -> dict[str, int]:
        """The live process of every instance, and of NATS when this cluster runs it."""
        pids = {iid: p.pid for iid, p in self.procs.items() if p.poll() is None}
        if self._nats is not None and self._nats.poll() is None:
            pids["nats"] = self._nats.pid
        return pids

    def kill(self, instance_id: str) -> None:
        """SIGKILL one instance (no drain, no goodbye), as a crash would."""
        proc = self.procs[instance_id]
        proc.kill()
        proc.wait()

    def stop(self, timeout: float = 30.0) -> None:
        for name in (*self.procs, "nats"):
            self.supervision.stopping(name)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._nats is not None and self._nats.poll() is None:
            self._nats.terminate()
            try:
                self._nats.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._nats.kill()
                self._nats.wait()
