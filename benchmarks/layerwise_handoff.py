"""Hand-off latency after the last prefill layer: whole-block vs layer-wise, same run.

One process runs a real NATS server, the cache-manager, a transfer node (shared memory), a prefill
and a decode instance; rounds alternate the prefill's mode. The clock starts on the engine thread
when the last layer of the prompt's final chunk has written its KV, and stops when decode holds
every block, verified (``KVHandOff.receive`` returned). Whole-block ships every layer after that
moment; layer-wise ships all but the last before it. "One layer" is the whole-block figure divided
by the number of layers: the aim is that layer-wise adds at most that.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import tempfile
import time
from typing import Any

from halfmoon.engine.hooks import LayerHook
from halfmoon.protocol import codecs
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.subjects import Subjects
from halfmoon.protocol.work import PrefillRequest
from halfmoon.service import ServiceHost, request
from halfmoon.service.worker import WorkerConfig
from halfmoon.services.cache_manager.service import CacheManagerConfig, CacheManagerService
from halfmoon.services.decode.service import DecodeService
from halfmoon.services.prefill.service import PrefillService
from halfmoon.services.transfer.service import TransferConfig, TransferService
from rich.console import Console
from rich.table import Table

from benchmarks.inproc import model_or_default, nats_server

SECRET = "layerwise-handoff-benchmark-0123456789"
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


class _LastLayerClock(LayerHook):
    """Wraps the engine's hook; notes when the final chunk's last layer is in the cache."""

    def __init__(self, inner: LayerHook, last: int, marks: list[float]) -> None:
        self.inner, self.last, self.marks = inner, last, marks

    def before_layer(self, layer, chunks, cache) -> None:  # type: ignore[no-untyped-def]
        self.inner.before_layer(layer, chunks, cache)

    def after_layer(self, layer, chunks, cache) -> None:  # type: ignore[no-untyped-def]
        if layer == self.last and any(chunk.samples for chunk in chunks):
            self.marks.append(time.perf_counter())
        self.inner.after_layer(layer, chunks, cache)


async def one_round(nc: Any, ns: str, prefill: PrefillService, decode: DecodeService, prompt: list[int],
                    rid: str, last: list[float], ready: list[float]) -> float:
    subjects, done = Subjects(ns), asyncio.Event()

    async def on_event(msg: Any) -> None:
        if getattr(codecs.STREAM.decode(msg.data), "finish_reason", None) is not None:
            done.set()

    sub = await nc.subscribe(subjects.stream(rid), cb=on_event)
    before = len(ready)
    await request(nc, subjects.prefill_submit(prefill.instance_id),
                  PrefillRequest(request_id=rid, prompt_token_ids=tuple(prompt), sampling=GREEDY,
                                 decode_instance=decode.instance_id, stream_subject=subjects.stream(rid),
                                 deadline=time.time() + 300), codecs.SUBMIT_REPLY, 30)
    await asyncio.wait_for(done.wait(), 300)
    await sub.unsubscribe()
    assert len(ready) == before + 1, "decode did not receive the KV"
    return ready[-1] - last[-1]


async def run(model: str, prompt_tokens: int, rounds: int) -> tuple[int, dict[bool, list[float]]]:
    """The model's layer count, and the latencies (seconds) by mode (True: layer-wise)."""
    import nats

    with nats_server() as url:
        ns = "bench"
        common: dict[str, Any] = dict(nats_url=url, namespace=ns, heartbeat_interval_s=0.2, cluster_secret=SECRET)
        worker = dict(common, model_dir=model, kv_cache_bytes=512 << 20, max_num_batched_tokens=8192,
                      prefill_chunk_size=8192)
        cm = CacheManagerService(CacheManagerConfig(**common))
        node = TransferService(TransferConfig(**common, dram_bytes=1 << 30))
        prefill, decode = PrefillService(WorkerConfig(**worker)), DecodeService(WorkerConfig(**worker))
        async with ServiceHost(cm), ServiceHost(node), ServiceHost(prefill), ServiceHost(decode):
            while node.instance_id not in cm.nodes or not prefill.transfer_nodes.ordered():
                await asyncio.sleep(0.05)
            assert prefill.engine is not None
            layers = prefill.engine.layout.num_layers
            last: list[float] = []
            ready: list[float] = []
            await prefill.engine.call(lambda e: setattr(e.runner, "layer_hook", _LastLayerClock(
                e.layer_export, layers - 1, last)))
            receive = decode.handoff.receive

            async def timed_receive(*args: Any, **kwargs: Any) -> list[bytes]:
                out = await receive(*args, **kwargs)
                ready.append(time.perf_counter())
                return out

            decode.handoff.receive = timed_receive  # type: ignore[method-assign]
            nc = await nats.connect(url)
            rng = random.Random(0)
            results: dict[bool, list[float]] = {True: [], False: []}
            for i in range(2 * rounds + 2):  # the first pair warms up
                layerwise = i % 2 == 0
                prefill.config = dataclasses.replace(prefill.config, layerwise_handoff=layerwise)
                prompt = [rng.randrange(10, 200) for _ in range(prompt_tokens)]  # no prefix reuse
                latency = await one_round(nc, ns, prefill, decode, prompt, f"bench-{i}", last, ready)
                if i >= 2:
                    results[layerwise].append(latency)
            await nc.close()
            return layers, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="model directory (default: a random-initialised 16-layer model)")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = model_or_default(args.model, tmp)
        layers, results = asyncio.run(run(model, args.prompt_tokens, args.rounds))
    whole, layerwise = statistics.median(results[False]), statistics.median(results[True])
    table = Table(title=f"hand-off after the last layer, {args.prompt_tokens}-token prompt, {layers} layers, "
                        f"{args.rounds} rounds each (median ms)")
    for column in ("whole-block", "layer-wise", "layer-wise / whole", "one layer (whole / layers)",
                   "layer-wise - one layer"):
        table.add_column(column, justify="right")
    one = whole / layers
    table.add_row(f"{whole * 1e3:.1f}", f"{layerwise * 1e3:.1f}", f"{layerwise / whole:.2f}", f"{one * 1e3:.1f}",
                  f"{(layerwise - one) * 1e3:+.1f}")
    Console().print(table)
    Console().print(f"all rounds (ms): whole {[round(x * 1e3, 1) for x in results[False]]}, "
                    f"layer-wise {[round(x * 1e3, 1) for x in results[True]]}")


if __name__ == "__main__":
    main()
