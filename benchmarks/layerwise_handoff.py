"""Hand-off latency after the last prefill layer: whole-block vs layer-wise, same run.

One process runs a real NATS server, the cache-manager, a transfer node (shared memory), a prefill
and a decode instance; rounds alternate the prefill's mode. The clock starts on the engine thread
when the last layer of the prompt's final chunk has written its KV, and stops when decode holds
every block, verified (``KVHandOff.receive`` returned). Whole-block ships every layer after that
moment; layer-wise ships all but the last before it. "One layer" is the whole-block figure divided
by the number of layers: the aim is that layer-wise adds at most that after prefill computed its last
layer. The hook that starts the clock runs right after the last layer's attention, before its o_proj
and MLP, the final norm, lm_head and sampling, so a second clock starts when the engine step that
sampled the first token ends (prefill's compute is over; decode cannot start without that token).

It also times each step after the last layer (both sides, every service in this one
process, one clock): each is wrapped where it is called and shown as the median of its start and end
in ms after that moment, so what sits on the critical path, and what overlaps it, can be read off.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

from rich.console import Console
from rich.table import Table

from benchmarks.inproc import model_or_default, nats_server
from halfmoon.engine.hooks import LayerHook
from halfmoon.protocol import codecs
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.subjects import Subjects
from halfmoon.protocol.work import PrefillRequest
from halfmoon.runtime import ServiceHost, request
from halfmoon.runtime.layer_writer import LayerWriter
from halfmoon.runtime.worker import WorkerConfig
from halfmoon.services.cache_manager.service import CacheManagerConfig, CacheManagerService
from halfmoon.services.decode.service import DecodeService
from halfmoon.services.prefill.service import PrefillService
from halfmoon.services.transfer.service import TransferConfig, TransferService
from halfmoon.transfer.shm import ShmTransport

SECRET = "layerwise-handoff-benchmark-0123456789"
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


class Timeline:
    """Steps of the current round: (name, start, end) on ``time.perf_counter``'s clock."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, float, float]] = []

    def wrap(self, owner: Any, attr: str, name: Callable[..., str | None] | str) -> None:
        """Time every call of ``owner.attr`` (an async method); ``name`` may name a call from its
        arguments, or skip it (None)."""
        inner = getattr(owner, attr, None)
        if inner is None:  # a step this version of the code does not have
            return
        bound = not isinstance(owner, type)

        async def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await inner(*args, **kwargs)
            finally:
                label = name(*(args if bound else args[1:]), **kwargs) if callable(name) else name
                if label is not None:
                    self.steps.append((label, start, time.perf_counter()))

        setattr(owner, attr, timed)

    def note(self, name: str) -> None:
        now = time.perf_counter()
        self.steps.append((name, now, now))


def instrument(prefill: PrefillService, decode: DecodeService, layers: int, timeline: Timeline) -> None:
    """Wrap each step a hand-off takes after prefill's last layer (names as shown in the breakdown)."""
    last = f"layers ..{layers - 1}"
    timeline.wrap(prefill, "_compute", "prefill: engine returns the first token")
    timeline.wrap(LayerWriter, "_ship", lambda layers_, *a: f"prefill: seal+write+announce {last}"
                  if layers_.stop == layers else None)
    timeline.wrap(prefill, "publish_event", "prefill: first token's event")
    timeline.wrap(prefill.prefix, "publish_cache_events", "prefill: cache events (engine call + publish)")
    timeline.wrap(prefill.handoff, "send", "prefill: kv_write (commit, write whole, put_end, park)")
    timeline.wrap(prefill.handoff, "commit", "prefill: kv_commit after the signal (commit, put_end)")
    timeline.wrap(ShmTransport, "commit", "prefill: COMMIT to the node")
    timeline.wrap(prefill, "request", lambda subject, message, *a, **k: f"prefill: {type(message).__name__} "
                  "round trip" if type(message).__name__ in ("PutEnd", "DecodeRequest") else None)
    timeline.wrap(decode, "_serve", "decode: request task")
    timeline.wrap(decode.layers, "on_progress", lambda msg, *a: f"decode: read+verify {last}"
                  if msg.layers_done == layers else None)
    timeline.wrap(decode.layers, "take", "decode: wait for announced layers")
    timeline.wrap(decode.handoff, "receive", "decode: KVHandOff.receive")


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


def _timed_step(step: Callable[[], list[Any]], marks: list[float]) -> Callable[[], list[Any]]:
    """The engine's ``step``, noting when one that produced output (the first token) ends."""

    def timed() -> list[Any]:
        out = step()
        if out:
            marks.append(time.perf_counter())
        return out

    return timed


async def one_round(nc: Any, ns: str, prefill: PrefillService, decode: DecodeService, prompt: list[int],
                    rid: str, last: list[float], ready: list[float], timeline: Timeline) -> float:
    subjects, done = Subjects(ns), asyncio.Event()

    async def on_event(msg: Any) -> None:
        if getattr(codecs.STREAM.decode(msg.data), "finish_reason", None) is not None:
            timeline.note("client: decode's first token arrives")
            done.set()

    sub = await nc.subscribe(subjects.stream("gateway-0", rid), cb=on_event)
    before = len(ready)
    await request(nc, subjects.prefill_submit(prefill.instance_id, "gateway-0"),
                  PrefillRequest(request_id=rid, prompt_token_ids=tuple(prompt), sampling=GREEDY,
                                 decode_instance=decode.instance_id,
                                 deadline=time.time() + 300), codecs.SUBMIT_REPLY, 30)
    await asyncio.wait_for(done.wait(), 300)
    await sub.unsubscribe()
    assert len(ready) == before + 1, "decode did not receive the KV"
    return ready[-1] - last[-1]


Steps = dict[str, list[tuple[float, float]]]  # step -> (start, end) after the last layer, one per round


class Results(NamedTuple):
    layers: int
    latency: dict[bool, list[float]]  # seconds after the last layer's KV, by mode (True: layer-wise)
    after_token: dict[bool, list[float]]  # seconds after the step that sampled the first token
    steps: dict[bool, Steps]


async def run(model: str, prompt_tokens: int, rounds: int) -> Results:
    import nats

    with nats_server() as url:
        ns = "bench"
        common: dict[str, Any] = dict(nats_url=url, namespace=ns, heartbeat_interval_s=0.2, cluster_secret=SECRET)
        worker = dict(common, model_dir=model, kv_cache_bytes=512 << 20, max_num_batched_tokens=8192,
                      prefill_chunk_size=8192, dtype="float32")  # the KV sizes docs/BENCHMARKS.md states
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
            sampled: list[float] = []
            await prefill.engine.call(lambda e: setattr(e, "step", _timed_step(e.step, sampled)))
            receive = decode.handoff.receive

            async def timed_receive(*args: Any, **kwargs: Any) -> list[bytes]:
                out = await receive(*args, **kwargs)
                ready.append(time.perf_counter())
                return out

            decode.handoff.receive = timed_receive  # type: ignore[method-assign]
            timeline = Timeline()
            instrument(prefill, decode, layers, timeline)
            nc = await nats.connect(url)
            rng = random.Random(0)
            results: dict[bool, list[float]] = {True: [], False: []}
            after_token: dict[bool, list[float]] = {True: [], False: []}
            steps: dict[bool, Steps] = {True: defaultdict(list), False: defaultdict(list)}
            for i in range(2 * rounds + 2):  # the first pair warms up
                layerwise = i % 2 == 0
                prefill.config = dataclasses.replace(prefill.config, layerwise_handoff=layerwise)
                prompt = [rng.randrange(10, 200) for _ in range(prompt_tokens)]  # no prefix reuse
                timeline.steps.clear()
                latency = await one_round(nc, ns, prefill, decode, prompt, f"bench-{i}", last, ready, timeline)
                if i >= 2:
                    results[layerwise].append(latency)
                    after_token[layerwise].append(ready[-1] - sampled[-1])
                    timeline.steps.append(("prefill: engine step that sampled the first token ends", sampled[-1],
                                           sampled[-1]))
                    for name, start, end in timeline.steps:
                        if end >= last[-1]:  # steps that ended before the last layer are off the path
                            steps[layerwise][name].append((start - last[-1], end - last[-1]))
            await nc.close()
            return Results(layers, results, after_token, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="model directory (default: a random-initialised 16-layer model)")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = model_or_default(args.model, tmp)
        layers, results, after_token, steps = asyncio.run(run(model, args.prompt_tokens, args.rounds))
    one = statistics.median(results[False]) / layers
    table = Table(title=f"decode holds the KV, {args.prompt_tokens}-token prompt, {layers} layers, {args.rounds} "
                        f"rounds each (median ms); one layer (whole-block after the KV / layers) = {one * 1e3:.1f}")
    for column in ("clock starts", "whole-block", "layer-wise", "layer-wise / whole", "layer-wise - one layer"):
        table.add_column(column, justify="left" if column == "clock starts" else "right")
    for label, by_mode in (("last layer's KV written", results), ("first token sampled", after_token)):
        whole, layerwise = statistics.median(by_mode[False]), statistics.median(by_mode[True])
        table.add_row(label, f"{whole * 1e3:.1f}", f"{layerwise * 1e3:.1f}", f"{layerwise / whole:.2f}",
                      f"{(layerwise - one) * 1e3:+.1f}")
        Console().print(f"all rounds after the {label} (ms): whole {[round(x * 1e3, 1) for x in by_mode[False]]}, "
                        f"layer-wise {[round(x * 1e3, 1) for x in by_mode[True]]}")
    Console().print(table)
    Console().print(breakdown(steps, args.rounds))


def breakdown(steps: dict[bool, Steps], rounds: int) -> Table:
    """Each step's median start and end (ms after the last layer's KV was written), by mode."""
    table = Table(title="after the last layer: median start -> end, ms (n: rounds with the step)")
    for column in ("step", "whole-block", "layer-wise"):
        table.add_column(column, justify="left" if column == "step" else "right")

    def cell(times: list[tuple[float, float]]) -> str:
        if not times:
            return "-"
        start, end = (statistics.median(t[i] for t in times) * 1e3 for i in (0, 1))
        n = "" if len(times) == rounds else f" (n={len(times)})"
        return f"{start:+.1f} -> {end:+.1f}{n}" if end - start > 5e-5 else f"{end:+.1f}{n}"

    names = sorted({*steps[False], *steps[True]}, key=lambda name: statistics.median(
        end for _, end in steps[True].get(name) or steps[False][name]))
    for name in names:
        table.add_row(name, cell(steps[False].get(name, [])), cell(steps[True].get(name, [])))
    return table


if __name__ == "__main__":
    main()
