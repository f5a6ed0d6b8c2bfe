"""The live conductor names a chunked pipeline-parallel prefill (CPP) only when its cost model predicts it
pays: real NATS, peers that heartbeat a KV spec (so the KV-centric policy runs), and the policy's prior
speed set low so that prompts of a few hundred tokens are "long"."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
from fake_instances import LoadReporter, wait_until

from halfmoon.core.kv_spec import KVSpec
from halfmoon.protocol import (
    Load,
    Role,
    SamplingParams,
    ScheduleAccepted,
    ScheduleRejected,
    ScheduleRequest,
    Subjects,
    codecs,
)
from halfmoon.runtime import ServiceConfig, ServiceHost, request
from halfmoon.services.conductor.policy_config import PolicySettings
from halfmoon.services.conductor.service import ConductorConfig, ConductorService

SPEC = KVSpec(model_fingerprint="ab" * 16, block_size=16, dtype="float32", num_layers=4, num_kv_heads=2, head_dim=16)
# 100 tokens/s and a 2 s TTFT SLO: 150 tokens fit one instance, 300 do not; 32-token chunks through 2 stages
# finish 300 tokens in about 1.7 s.
POLICY = dict(prefill_tokens_per_s=100.0, ttft_slo_s=2.0, cpp_stages=2, cpp_min_tokens=64, cpp_chunk_tokens=32,
              cpp_hop_bytes_per_token=256)

CPP_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PolicySettings) if f.name.startswith("cpp_")}


class SpecReporter(LoadReporter):
    @property
    def kv_spec(self) -> KVSpec:
        return SPEC


def reporter(url: str, namespace: str, iid: str, role: Role) -> ServiceHost:
    svc = SpecReporter(ServiceConfig(nats_url=url, namespace=namespace, instance_id=iid, heartbeat_interval_s=0.05),
                       role)
    svc.current_load = Load(free_kv_blocks=1000, total_kv_blocks=1000)
    return ServiceHost(svc)


async def schedule(nc: Any, namespace: str, tokens: int) -> ScheduleAccepted | ScheduleRejected:
    req = ScheduleRequest(request_id=f"r{tokens}-{time.monotonic_ns()}", model="tiny", prompt_len=tokens,
                          prompt_token_ids=tuple(range(1, tokens + 1)), sampling=SamplingParams(max_tokens=4),
                          deadline=time.time() + 30)
    return await request(nc, Subjects(namespace).schedule, req, codecs.SCHEDULE_REPLY, timeout=5)


async def run(nats_server: Any, namespace: str, nc: Any, prefills: int, tokens: list[int],
              **policy: Any) -> list[ScheduleAccepted | ScheduleRejected]:
    config = ConductorConfig(nats_url=nats_server.url, namespace=namespace, instance_id="conductor-0",
                             heartbeat_interval_s=0.1, warmup_s=0.2, **{**POLICY, **policy})
    conductor = ConductorService(config)
    hosts = [reporter(nats_server.url, namespace, f"p{i}", Role.PREFILL) for i in range(prefills)]
    hosts.append(reporter(nats_server.url, namespace, "d0", Role.DECODE))
    async with ServiceHost(conductor):
        for host in hosts:
            await host.__aenter__()
        try:
            ids = {f"p{i}" for i in range(prefills)} | {"d0"}
            await wait_until(lambda: ids <= set(conductor.table.ids()) and conductor.policy.spec is not None)
            return [await schedule(nc, namespace, n) for n in tokens]
        finally:
            for host in reversed(hosts):
                await host.__aexit__(None, None, None)


def pipeline_of(reply: ScheduleAccepted | ScheduleRejected) -> tuple[str, ...] | None:
    return reply.pipeline if isinstance(reply, ScheduleAccepted) else None


class TestPipelinesOnlyWhatOneInstanceCannotServe:
    async def test_long_prompt_gets_two_stages_short_one_a_single_instance(self, nats_server, namespace, nc):
        # one conductor each: the first placement's work would count in the second one's queue estimates
        (long,) = await run(nats_server, namespace, nc, prefills=2, tokens=[300])
        (short,) = await run(nats_server, namespace, nc, prefills=2, tokens=[150])
        assert isinstance(long, ScheduleAccepted) and len(long.pipeline) == 1
        assert {long.prefill_instance, *long.pipeline} == {"p0", "p1"}
        assert long.predicted_ttft_ms is not None and long.predicted_ttft_ms < 2000  # the pipeline's prediction
        assert pipeline_of(short) == ()

    async def test_a_pipelined_request_loads_every_stage(self, nats_server, namespace, nc):
        # the first pipeline's work is in both its stages' queue estimates: the second pipeline, over four
        # instances, takes the two others
        first, second = await run(nats_server, namespace, nc, prefills=4, tokens=[300, 300])
        assert isinstance(first, ScheduleAccepted) and isinstance(second, ScheduleAccepted)
        assert first.pipeline and second.pipeline
        assert not {first.prefill_instance, *first.pipeline} & {second.prefill_instance, *second.pipeline}

    async def test_one_prefill_instance_cannot_pipeline(self, nats_server, namespace, nc):
        (long,) = await run(nats_server, namespace, nc, prefills=1, tokens=[300])
        assert isinstance(long, ScheduleRejected)  # the single instance misses the SLO: rejected early

    async def test_a_pipeline_that_would_not_pay_is_not_used(self, nats_server, namespace, nc):
        # hidden states of 100 MB a token: the hops cost more than the stages save
        (long,) = await run(nats_server, namespace, nc, prefills=2, tokens=[300], cpp_hop_bytes_per_token=100 << 20)
        assert isinstance(long, ScheduleRejected)


class TestThreshold:
    @pytest.mark.parametrize(("tokens", "stages"), [(100, 1), (50, 0)])
    async def test_without_rescue_only_any_prompt_over_the_threshold(self, nats_server, namespace, nc, tokens, stages):
        (reply,) = await run(nats_server, namespace, nc, prefills=2, tokens=[tokens], cpp_rescue_only=False)
        assert isinstance(reply, ScheduleAccepted) and len(reply.pipeline) == stages

    async def test_off_by_default(self, nats_server, namespace, nc):
        (reply,) = await run(nats_server, namespace, nc, prefills=2, tokens=[300], ttft_slo_s=30.0, **CPP_DEFAULTS)
        assert pipeline_of(reply) == ()
