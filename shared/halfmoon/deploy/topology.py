"""The service list: the one source of truth for `halfmoon up`, the tests and docker-compose.yml."""

from __future__ import annotations

from typing import NamedTuple


class ServiceSpec(NamedTuple):
    """One service of a deployment: its module (run as ``python -m``), how many, whether it scales."""

    name: str
    module: str
    scalable: bool

    @property
    def command(self) -> list[str]:
        return ["python", "-m", self.module]


SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec("conductor", "halfmoon.services.conductor", scalable=True),
    ServiceSpec("cache-manager", "halfmoon.services.cache_manager", scalable=True),  # one active, the rest standbys
    ServiceSpec("transfer", "halfmoon.services.transfer", scalable=True),
    ServiceSpec("prefill", "halfmoon.services.prefill", scalable=True),
    ServiceSpec("decode", "halfmoon.services.decode", scalable=True),
    ServiceSpec("gateway", "halfmoon.services.gateway", scalable=True),
)

# Services a deployment runs only when asked (``halfmoon up --aggregated N``); none by default, and not yet
# in the compose and Kubernetes manifests.
OPTIONAL_SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec("aggregated", "halfmoon.services.aggregated", scalable=True),
)

REQUEST_PATH = ("gateway", "conductor", "prefill", "transfer", "decode")
ENGINE_SERVICES = ("prefill", "decode", "aggregated")  # the processes that run a model engine


def instances(counts: dict[str, int]) -> list[tuple[ServiceSpec, str]]:
    """(spec, instance id) for every process of a deployment; unnamed services run once (optional ones not)."""
    unknown = set(counts) - {s.name for s in (*SERVICES, *OPTIONAL_SERVICES)}
    if unknown:
        raise ValueError(f"unknown services {sorted(unknown)}")
    result: list[tuple[ServiceSpec, str]] = []
    for spec in (*SERVICES, *OPTIONAL_SERVICES):
        count = counts.get(spec.name, 0 if spec in OPTIONAL_SERVICES else 1)
        if count < 0 or (count > 1 and not spec.scalable):
            raise ValueError(f"{spec.name} runs {'once' if not spec.scalable else 'zero or more times'}, not {count}")
        result.extend((spec, f"{spec.name}-{i}") for i in range(count))
    return result
