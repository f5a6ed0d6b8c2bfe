"""The services move KV over the paths both ends have: here a transfer node offering Mooncake's
engine (its TCP transport, run for real) and workers that use it instead of shared memory. The
hand-off and the pool reads then go one-sided, and the outputs are the engine's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from halfmoon.runtime.data_plane import DataPlaneConfig
from halfmoon.transfer.failover import PathFailover
from tests.runtime.conftest import running, serve


@pytest.fixture
def mooncake() -> None:
    from halfmoon.transfer.mooncake import MooncakeUnavailable, engine_class

    try:
        engine_class()
    except MooncakeUnavailable as exc:
        pytest.skip(str(exc))


class TestConfiguredPaths:
    def test_unknown_paths_are_refused_and_tcp_is_always_on(self) -> None:
        assert DataPlaneConfig(data_paths="mooncake").paths == {"mooncake", "tcp"}
        assert DataPlaneConfig(data_paths="").paths == {"tcp"}
        with pytest.raises(ValueError, match="unknown path"):
            DataPlaneConfig(data_paths="shm,infiniband")
        with pytest.raises(ValueError, match="mooncake_protocol"):
            DataPlaneConfig(mooncake_protocol="nvlink")


@pytest.mark.usefixtures("mooncake")
class TestMooncakeHandOff:
    @pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole-block"])
    async def test_kv_moves_through_the_mooncake_engine_not_the_sockets(self, nats_server, nc, namespace: str,  # type: ignore[no-untyped-def]
                                                                      tiny_model_dir: Path, layerwise: bool, expected: list[int]) -> None:
        async with running(nats_server, namespace, tiny_model_dir, layerwise, node_paths="mooncake,tcp",
                           worker_paths="mooncake,tcp") as cluster:
            server = cluster.node.server
            assert server is not None and server.offers.mooncake is not None  # offered in HELLO
            assert await serve(nc, namespace, cluster, "r-mooncake") == expected
            for worker in (cluster.prefill, cluster.decode):
                node = await worker.transfer.transport(cluster.node.address)
                assert isinstance(node, PathFailover) and [p.kind for p in node.paths] == ["mooncake", "tcp"]
                assert node.last_kind == "mooncake"
            # prefill wrote each layer and decode read it one-sided: no block crossed the node's sockets
            assert server.payload_bytes_in == server.payload_bytes_out == 0

    async def test_a_node_without_the_offer_is_reached_over_tcp(self, nats_server, nc, namespace: str,  # type: ignore[no-untyped-def]
                                                               tiny_model_dir: Path, expected: list[int]) -> None:
        # workers that may use Mooncake, a node without it
        async with running(nats_server, namespace, tiny_model_dir, layerwise=False, node_paths="tcp",
                           worker_paths="mooncake,tcp") as cluster:
            assert await serve(nc, namespace, cluster, "r-tcp") == expected
            node = await cluster.decode.transfer.transport(cluster.node.address)
            assert not isinstance(node, PathFailover)  # its HELLO offered nothing: TCP alone
            assert cluster.node.server is not None and cluster.node.server.payload_bytes_in > 0
