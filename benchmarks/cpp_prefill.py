"""TTFT of a long prompt: one prefill instance vs a 2-stage chunked pipeline (CPP), same run.

One process runs a real NATS server, the cache-manager, a transfer node (shared memory), two prefill
instances and a decode instance; rounds alternate single-instance prefill (submitted with no pipeline) and
the 2-stage pipeline (submitted with the other instance as stage 1), each with a fresh random prompt (no
prefix reuse). TTFT is from the submit to the first token's event at the client; each round also checks
that the pipeline's tokens equal what a single engine produces.

On a machine with few cores the two stages share the same cores (and, in one process, the same torch
thread pool), so the pipeline's overlap cannot show: this measures the pipeline's overhead (hidden states
over NATS, per-stage KV writes, the extra hop), not the speed-up of stages on separate machines.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.inproc import model_or_default, nats_server, timed_request
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.runtime import ServiceHost
from halfmoon.runtime.worker import WorkerConfig
from halfmoon.services.cache_manager.service import (
    CacheManagerConfig,
    CacheManagerService,
)
from halfmoon.services.decode.service import DecodeService
from halfmoon.services.prefill.service import PrefillService
from halfmoon.services.transfer.service import TransferConfig, TransferService

SECRET = "cpp-prefill-benchmark-0123456789abcdef"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


async def run(model: str, prompt_tokens: int, chunk: int, rounds: int) -> dict[str, list[float]]:
    import nats

    with nats_server() as url:
        ns = "bench"
        common: dict[str, Any] = dict(nats_url=url, namespace=ns, heartbeat_interval_s=0.2, cluster_secret=SECRET)
        worker = dict(common, model_dir=model, dtype="float32", kv_cache_bytes=512 << 20,
                      max_num_batched_tokens=max(2048, chunk), prefill_chunk_size=chunk, local_prefix_cache=False)
        cm = CacheManagerService(CacheManagerConfig(**common))
        node = TransferService(TransferConfig(**common, dram_bytes=1 << 30))
        head, tail = PrefillService(WorkerConfig(**worker)), PrefillService(WorkerConfig(**worker))
        decode = DecodeService(WorkerConfig(**worker))
        reference = LLMEngine(EngineConfig(model=model, dtype="float32", prefill_chunk_size=chunk,
                                           max_num_batched_tokens=max(2048, chunk), kv_cache_bytes=512 << 20))
        async with ServiceHost(cm), ServiceHost(node), ServiceHost(head), ServiceHost(tail), ServiceHost(decode):
            while node.instance_id not in cm.nodes or not (head.transfer_nodes.ordered()
                                                            and tail.transfer_nodes.ordered()):
                await asyncio.sleep(0.05)
            nc = await nats.connect(url)
            rng = random.Random(0)
            results: dict[str, list[float]] = {"single": [], "2-stage": []}
            for i in range(2 * rounds + 2):  # the first pair warms up
                mode = "2-stage" if i % 2 else "single"
                prompt = [rng.randrange(10, 200) for _ in range(prompt_tokens)]
                ttft, tokens = await timed_request(nc, ns, head.instance_id, decode.instance_id, prompt,
                                                   f"bench-{i}", GREEDY,
                                                   (tail.instance_id,) if mode == "2-stage" else ())
                assert tokens == reference.generate([prompt], GREEDY)[0], f"round {i} ({mode}): tokens differ"
                if i >= 2:
                    results[mode].append(ttft)
            await nc.close()
            return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="model directory (default: a random-initialised 16-layer model)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256, help="prefill_chunk_size (the pipeline's chunk too)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = model_or_default(args.model, tmp)
        results = asyncio.run(run(model, args.prompt_tokens, args.chunk, args.rounds))
    single, piped = statistics.median(results["single"]), statistics.median(results["2-stage"])
    table = Table(title=f"TTFT, {args.prompt_tokens}-token prompt in {args.chunk}-token chunks, {args.rounds} rounds "
                        "each (median s; both stages share this machine's cores)")
    for column in ("single instance", "2-stage pipeline", "2-stage / single", "single rounds", "2-stage rounds"):
        table.add_column(column, justify="right")
    table.add_row(f"{single:.3f}", f"{piped:.3f}", f"{piped / single:.2f}",
                  " ".join(f"{x:.2f}" for x in results["single"]), " ".join(f"{x:.2f}" for x in results["2-stage"]))
    Console().print(table)


if __name__ == "__main__":
    main()
