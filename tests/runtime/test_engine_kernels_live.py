"""An engine instance reports the CPU kernels it runs: in its heartbeats on real NATS and in its Prometheus
metrics, the same report the engine's own kernels give (native and its ISA level here, or the fallback); and
that its engine paces prompts to a step target of their own, which the conductor reads to admit one paced."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from halfmoon.engine import native
from halfmoon.protocol import codecs
from halfmoon.protocol.subjects import Subjects
from halfmoon.runtime import ServiceHost
from halfmoon.runtime.worker import WorkerConfig
from halfmoon.services.decode.service import DecodeService
from halfmoon.telemetry.metrics import METRICS


async def test_heartbeat_and_metrics_carry_the_kernel_report(nats_server: Any, nc: Any, namespace: str,
                                                             tiny_model_dir: Path) -> None:
    decode = DecodeService(WorkerConfig(nats_url=nats_server.url, namespace=namespace, heartbeat_interval_s=0.1,
                                        cluster_secret="engine-kernels-tests-secret-0123456789",
                                        model_dir=str(tiny_model_dir), dtype="bfloat16", device="cpu",
                                        kv_cache_bytes=8 << 20))
    beats: asyncio.Queue = asyncio.Queue()

    async def on_beat(msg: Any) -> None:
        beat = codecs.HEARTBEAT.decode(msg.data)
        if beat.instance_id == decode.instance_id:
            beats.put_nowait(beat)

    await nc.subscribe(Subjects(namespace).heartbeat, cb=on_beat)
    async with ServiceHost(decode):
        beat = await asyncio.wait_for(beats.get(), 30)  # the first, sent as it registers
    expected = native.report("cpu")
    assert beat.kernels == expected and beat.kernels.kind in ("native", "fallback")
    assert beat.paces_prompts
    labels = f'instance="{decode.instance_id}",isa="{expected.isa}",kind="{expected.kind}",reason="{expected.reason}"'
    assert f"halfmoon_engine_kernels{{{labels}}} 1.0" in METRICS.render().decode()
