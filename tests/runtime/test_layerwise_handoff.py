"""Prefill hands KV to decode layer by layer (the cluster: tests/runtime/conftest.py), in one process so
the test can hold prefill's last layer until decode says it has layer 0, an ordering proved by events,
not by timing."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from halfmoon.engine.hooks import LayerHook
from halfmoon.protocol.work import KVProgress
from halfmoon.transfer.transport import TransferError
from tests.runtime.conftest import Cluster, count_streamed, running, serve


class _Gate(LayerHook):
    """Wraps the engine's own hook; holds the last layer of a prompt's final chunk until ``released``."""

    def __init__(self, inner: LayerHook, last: int, released: threading.Event, wait_s: float,
                 events: list[str]) -> None:
        self.inner, self.last, self.released, self.wait_s, self.events = inner, last, released, wait_s, events

    def before_layer(self, layer, chunks, cache) -> None:  # type: ignore[no-untyped-def]
        if layer == self.last and any(chunk.samples for chunk in chunks):
            self.released.wait(self.wait_s)
            self.events.append("prefill computes its last layer")
        self.inner.before_layer(layer, chunks, cache)

    def after_layer(self, layer, chunks, cache) -> None:  # type: ignore[no-untyped-def]
        self.inner.after_layer(layer, chunks, cache)


class TestLayerwiseHandOff:
    async def test_decode_has_layer_zero_before_prefill_computes_its_last(self, cluster: Cluster, nc,  # type: ignore[no-untyped-def]
                                                                          namespace: str, expected: list[int]) -> None:
        layerwise = cluster.prefill.config.layerwise_handoff
        events: list[str] = []
        released = threading.Event()
        reader = cluster.decode.layers
        heard = reader.on_progress

        async def spy(msg: KVProgress, context: Any = None) -> None:
            await heard(msg, context)
            events.append(f"decode verified layers 0..{reader.layers_in(msg.request_id) - 1}")
            released.set()

        reader.on_progress = spy  # type: ignore[method-assign]
        streamed_counts = count_streamed(cluster)
        assert cluster.prefill.engine is not None
        last = cluster.prefill.engine.layout.num_layers - 1
        # whole-block has nothing to send before the last layer: the gate gives up after a second
        wait_s = 30.0 if layerwise else 1.0
        await cluster.prefill.engine.call(lambda e: setattr(e.runner, "layer_hook", _Gate(
            e.layer_export, last, released, wait_s, events)))
        tokens = await serve(nc, namespace, cluster, "r-layers")
        assert tokens == expected
        assert streamed_counts == [3]  # every block arrived before the hand-off: none read again
        if layerwise:
            # layers between the first and the last may land before or after the gate opens
            assert events[0] == "decode verified layers 0..0" and "prefill computes its last layer" in events
            assert events[-1] == f"decode verified layers 0..{last}"
        else:
            assert events == ["prefill computes its last layer", f"decode verified layers 0..{last}"]


class _FailsAfterFirstLayer:
    """A node's transport on prefill's side whose layer writes fail after the first (the node's segment
    went away mid-stream); everything else goes to the real transport."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.writes, self.failed = inner, 0, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def write_ranges(self, ranges: Any, payloads: Any) -> None:
        self.writes += 1
        if self.writes > 1:
            self.failed = True
            raise TransferError("segment gone")
        await self.inner.write_ranges(ranges, payloads)


class TestBlockLeftOutMidStream:
    async def test_decode_reads_whole_the_blocks_prefill_stopped_streaming(  # type: ignore[no-untyped-def]
            self, nats_server, namespace: str, tiny_model_dir: Path, nc, expected: list[int]) -> None:
        async with running(nats_server, namespace, tiny_model_dir, layerwise=True, num_nodes=2) as cluster:
            client, failing = cluster.prefill.transfer, cluster.nodes[1].address
            proxy = _FailsAfterFirstLayer(await client.transport(failing))
            opened = client.transport

            async def transport(address: str) -> Any:
                return proxy if address == failing else await opened(address)

            client.transport = transport  # type: ignore[method-assign]
            streamed_counts = count_streamed(cluster)
            tokens = await serve(nc, namespace, cluster, "r-midstream")
            assert proxy.failed, "no block was placed on the second node"
            # the second node's blocks carry layer 0 only: decode read them whole once prefill wrote them so
            assert len(streamed_counts) == 1 and 0 < streamed_counts[0] < 3
            assert tokens == expected
