"""After a prompt's last layer, how long until its blocks are in the pool: written whole after the step,
against layer by layer while the step computes (connectors/layer_store.py, the vLLM connector's), same run.

    python -m benchmarks.prompt_store [--tokens 512,1536] [--rounds 7] [--dtype bfloat16]

A pool of its own, as ``halfmoon up --pool-only`` runs it (NATS with per-role users, a cache-manager and a
transfer node, security on, each its own process); in this process the connector's ``PoolSession`` and an
engine thread. For every layer of SmolLM2-135M's shape (30 layers, 3 KV heads of 64) the engine thread
computes that layer's projections for the prompt's tokens (one thread, as vLLM computes on one core here:
attention is left out) and copies the layer's K and V into each block's payload, as the connector's
worker side's ``save_kv_layer`` does (connectors/vllm_worker.py). "whole" then stores the blocks
(put_start, seal and write, put_end: what the connector did before the layer-wise store); "layer-wise" placed them before the first layer, wrote each
layer as it was copied and only commits now. Rounds alternate the two, each on a fresh prompt.
Figures: the tail (the last layer's KV copied -> blocks published, on vLLM's step) and the step (first
layer -> published). Our own timing: diagnosis, not a figure against a peer.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from opentelemetry.trace import NoOpTracer
from rich.console import Console
from rich.table import Table

from benchmarks.peer_servers import POOL_COUNTS
from halfmoon.connectors.layer_store import LayerStore
from halfmoon.connectors.pool_session import PoolSession, session_config
from halfmoon.core.block_format import BlockLayout, blank_block, decode_block
from halfmoon.core.keys import BlockHasher, Namespace
from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol.permissions import KV_CLIENT

BLOCK = 16
LAYERS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 30, 3, 64, 576, 1536  # SmolLM2-135M


class Layer:
    """One decoder layer's projections (q, k, v, o, gate-up, down) for ``tokens`` rows."""

    def __init__(self, tokens: int, dtype: torch.dtype) -> None:
        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, dtype=dtype) / rows ** 0.5

        self.x = torch.randn(tokens, HIDDEN, dtype=dtype)
        self.qkv = weight(HIDDEN, HIDDEN + 2 * KV_HEADS * HEAD_DIM)
        self.o, self.gate_up, self.down = weight(HIDDEN, HIDDEN), weight(HIDDEN, 2 * INTERMEDIATE), weight(
            INTERMEDIATE, HIDDEN)

    def __call__(self) -> torch.Tensor:
        qkv = self.x @ self.qkv
        h = self.x + qkv[:, :HIDDEN] @ self.o
        gate, up = (h @ self.gate_up).chunk(2, dim=-1)
        return h + (torch.nn.functional.silu(gate) * up) @ self.down


def one_round(session: PoolSession, layout: BlockLayout, layer: Layer, kv: torch.Tensor, keys: list[bytes],
              layerwise: bool) -> tuple[float, float]:
    """(tail, step) in seconds."""
    payloads = [blank_block(layout, BLOCK) for _ in keys]
    bodies = [decode_block(layout, payload) for payload in payloads]
    started = time.perf_counter()
    store = LayerStore(session.pool, NoOpTracer(), "bench", keys, payloads, 0, BLOCK, session.call_soon) \
        if layerwise else None
    stored = session.submit(store.store()) if store is not None else None
    for n in range(LAYERS):
        layer()
        for body, block in zip(bodies, kv):
            body[n].copy_(block)
        if store is not None:
            store.sink(n)
    last = time.perf_counter()
    published = stored.result(60) if stored is not None else session.run(session.pool.store(keys, payloads, 0), 60)
    assert len(published) == len(keys), f"{len(published)} of {len(keys)} blocks stored"
    end = time.perf_counter()
    return end - last, end - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="512,1536", help="prompt lengths, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    layout = BlockLayout(bytes(32), dtype, LAYERS, KV_HEADS, HEAD_DIM)
    rng = random.Random(0)
    results: dict[tuple[int, bool], list[tuple[float, float]]] = {}
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(tmp, Path(tmp) / "pool", POOL_COUNTS, namespace="bench", gateway_port=0)
        cluster.start(timeout=120)
        session = None
        try:
            assert cluster.nats_auth is not None
            env = {"HALFMOON_NATS_URL": cluster.nats_url or "", "HALFMOON_NAMESPACE": cluster.namespace,
                   "HALFMOON_CLUSTER_SECRET": cluster.cluster_secret, **cluster.nats_auth.env(KV_CLIENT)}
            session = PoolSession(session_config({}, env), layout, "bench")
            hasher = BlockHasher(BLOCK, Namespace("prompt-store-benchmark"))
            for tokens in (int(t) for t in args.tokens.split(",")):
                layer = Layer(tokens, dtype)
                kv = torch.randn(tokens // BLOCK, 2, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
                for i in range(2 * args.rounds + 2):  # the first pair warms up
                    layerwise = i % 2 == 1
                    keys = hasher.keys([rng.randrange(3, 30000) for _ in range(tokens)])
                    with console.status(f"{tokens} tokens, round {i}"):
                        figures = one_round(session, session.pool.layout, layer, kv, keys, layerwise)
                    if i >= 2:
                        results.setdefault((tokens, layerwise), []).append(figures)
        finally:
            if session is not None:
                session.close()
            cluster.stop()
    table = Table(title=f"prompt blocks into the pool, SmolLM2-135M's shape, {args.dtype}, {args.rounds} rounds "
                        "each (median ms; our own timing)")
    for column in ("prompt tokens", "blocks", "tail whole", "tail layer-wise", "tail ratio", "step whole",
                   "step layer-wise", "step ratio"):
        table.add_column(column, justify="right")
    for tokens in sorted({t for t, _ in results}):
        whole, layerwise = results[(tokens, False)], results[(tokens, True)]
        tail = [statistics.median(r[0] for r in rounds) * 1e3 for rounds in (whole, layerwise)]
        step = [statistics.median(r[1] for r in rounds) * 1e3 for rounds in (whole, layerwise)]
        table.add_row(str(tokens), str(tokens // BLOCK), f"{tail[0]:.1f}", f"{tail[1]:.1f}",
                      f"{tail[1] / tail[0]:.2f}", f"{step[0]:.0f}", f"{step[1]:.0f}", f"{step[1] / step[0]:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
