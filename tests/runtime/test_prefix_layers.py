"""A prefix cached in the pool loads into prefill's engine layer by layer while the new tokens
compute (service/prefix_layers.py), on the real services and transfer node; a layer that fails
its MAC makes prefill recompute, never use it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from halfmoon.runtime.pool_client import Fetched
from halfmoon.telemetry.metrics import METRICS
from tests.runtime.conftest import Cluster, running, serve


def capture_fetches(cluster: Cluster) -> list[Fetched]:
    fetched: list[Fetched] = []
    fetch = cluster.prefill.prefix.fetch_pooled

    async def spy(keys: Any) -> Fetched:
        fetched.append(await fetch(keys))
        return fetched[-1]

    cluster.prefill.prefix.fetch_pooled = spy  # type: ignore[method-assign]
    return fetched


class TestPrefixFromThePool:
    async def test_a_pooled_prefix_loads_layer_by_layer_and_the_output_is_unchanged(  # type: ignore[no-untyped-def]
            self, nats_server, nc, namespace: str, tiny_model_dir: Path, expected: list[int]) -> None:
        # no local prefix cache: the second request's prefix can only come from the pool
        async with running(nats_server, namespace, tiny_model_dir, True, local_prefix_cache=False) as cluster:
            assert await serve(nc, namespace, cluster, "r-first") == expected  # its blocks go to the pool
            fetched = capture_fetches(cluster)
            assert await serve(nc, namespace, cluster, "r-again") == expected
            (again,) = fetched
            assert len(again.locations) == 2 and again.layers is not None  # both full blocks, layer by layer
            assert await again.layers.wait()  # every layer arrived and passed its MAC

    async def test_a_corrupt_layer_in_the_pool_is_recomputed_not_used(  # type: ignore[no-untyped-def]
            self, nats_server, nc, namespace: str, tiny_model_dir: Path, expected: list[int]) -> None:
        async with running(nats_server, namespace, tiny_model_dir, True, local_prefix_cache=False) as cluster:
            assert await serve(nc, namespace, cluster, "r-first") == expected
            dram = cluster.node.store.dram  # type: ignore[union-attr]
            for key, extent in dram.inventory():  # flip the last byte of every block: its last layer
                with dram.view(key) as view:
                    view[extent.size - 1] ^= 0xFF
            fetched = capture_fetches(cluster)
            reported = METRICS.pool_corrupt_blocks._value.get()
            assert await serve(nc, namespace, cluster, "r-again") == expected
            (again,) = fetched[-1:]
            assert again.layers is not None and not await again.layers.wait()
            assert METRICS.pool_corrupt_blocks._value.get() - reported == 2  # both blocks reported and dropped
            # written again from the recomputed KV: the next request reads them intact
            assert await serve(nc, namespace, cluster, "r-third") == expected
            third = fetched[-1]
            assert len(third.locations) == 2 and third.layers is not None and await third.layers.wait()

    async def test_a_whole_read_goes_where_the_lookup_said_without_asking_the_node(  # type: ignore[no-untyped-def]
            self, nats_server, nc, namespace: str, tiny_model_dir: Path, expected: list[int]) -> None:
        from halfmoon.transfer.framing import Op

        async with running(nats_server, namespace, tiny_model_dir, True, local_prefix_cache=False,
                           layerwise_prefix=False) as cluster:
            assert await serve(nc, namespace, cluster, "r-first") == expected
            server = cluster.node.server
            assert server is not None
            fetched, locates = capture_fetches(cluster), server.requests[Op.LOCATE]
            assert await serve(nc, namespace, cluster, "r-again") == expected
            (again,) = fetched
            assert again.layers is None and len(again.payloads) == 2  # read whole, before the compute
            assert server.requests[Op.LOCATE] == locates  # the lookup's extents were used as they are
