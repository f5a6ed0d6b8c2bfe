"""The online planner as a process of its own, for a deployment whose instances the launcher does not own
(compose): a :class:`RunningPlanner` over the actuator its config names, until SIGTERM."""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from halfmoon.deploy.planner import Actuator, PlannerConfig, RunningPlanner, Watch
from halfmoon.protocol.permissions import PLANNER
from halfmoon.runtime import ServiceConfig, connect_nats
from halfmoon.runtime.logs import setup_logging
from halfmoon.telemetry import setup_tracing


@dataclass(frozen=True)
class PlannerServiceConfig(ServiceConfig, PlannerConfig):
    actuator: str = field(default="docker", metadata={
        "help": "what starts and drains the engines: docker (the compose project's engine services) or "
                "kubernetes (the engine workloads' replicas, as the pod's service account)"})
    compose_project: str = field(default="", metadata={
        "help": "docker: the compose project whose engines it sizes (empty: the planner container's own)"})
    docker_socket: str = field(default="/var/run/docker.sock", metadata={"help": "docker: the engine's API socket"})
    engine_stop_timeout_s: float = field(default=40.0, metadata={
        "help": "docker: seconds a drained engine has to exit before Docker kills it (compose's stop_grace_period "
                "for the engines, above their drain_timeout_s), unless its container sets its own"})

    def __post_init__(self) -> None:
        ServiceConfig.__post_init__(self)
        PlannerConfig.__post_init__(self)
        if self.actuator not in ACTUATORS:
            raise ValueError(f"actuator must be one of {', '.join(ACTUATORS)}, got {self.actuator!r}")
        if self.engine_stop_timeout_s <= 0:
            raise ValueError(f"engine_stop_timeout_s must be > 0, got {self.engine_stop_timeout_s}")


def docker_actuator(config: PlannerServiceConfig) -> Actuator:
    from halfmoon.deploy.docker_actuator import DockerActuator, DockerApi, own_compose_project

    api = DockerApi(config.docker_socket)
    return DockerActuator(config.compose_project or own_compose_project(api), api, config.engine_stop_timeout_s)


def kubernetes_actuator(config: PlannerServiceConfig) -> Actuator:
    from halfmoon.deploy.kubernetes_actuator import ENGINE_WORKLOADS, KubernetesActuator

    return KubernetesActuator.in_cluster(ENGINE_WORKLOADS)


# NOTE: the platforms the planner can size; each builds its actuator from the config, importing its client
# only when chosen
ACTUATORS: dict[str, Callable[[PlannerServiceConfig], Actuator]] = {"docker": docker_actuator,
                                                                     "kubernetes": kubernetes_actuator}


def serve(config: PlannerServiceConfig) -> int:
    """Plan until SIGTERM or SIGINT, then give the drains under way ``drain_timeout_s`` to finish; the exit code."""
    if not config.instance_id:
        config = dataclasses.replace(config, instance_id=f"planner-{uuid.uuid4().hex[:8]}")
    setup_logging("planner", config.instance_id, config.log_level, config.log_format)
    provider = setup_tracing("planner", config.instance_id, config.trace_file or None)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _sig, _frame: stop.set())
    try:
        actuator = ACTUATORS[config.actuator](config)
        watch = Watch(lambda: connect_nats(config, config.instance_id, PLANNER), config.subjects)
        planner = RunningPlanner(config, actuator, watch, provider)
    except Exception:
        # e.g. no engines running yet, or NATS unreachable: the restart policy tries again
        logging.getLogger("halfmoon.planner").exception("the planner could not start")
        provider.shutdown()
        return 1
    try:
        planner.run(stop)
    finally:
        planner.close()
        actuator.close(config.drain_timeout_s)
    return 0
