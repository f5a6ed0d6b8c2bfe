"""Slow and greedy HTTP clients: a request body that stops arriving is answered 408 and its connection
closed after the gateway's idle limit (10 s by default), and one address holds at most 64 connections
(the 65th is refused) while other addresses are served."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import httpx

from halfmoon.deploy.local import LocalCluster
from tests.security.conftest import KEYS

SLOWLORIS = 50
PER_CLIENT = 64  # GatewayConfig.max_connections_per_client's default
BODY_IDLE_S = 10.0  # GatewayConfig.body_idle_timeout_s's default


def address(cluster: LocalCluster) -> tuple[str, int]:
    url = urlsplit(cluster.url)
    return url.hostname or "127.0.0.1", url.port or 80


async def open_from(cluster: LocalCluster, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(*address(cluster), local_addr=(source, 0))


async def stalled_body(cluster: LocalCluster) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Headers with a valid key, promising 1000 bytes of body, then 12 of them and silence."""
    reader, writer = await open_from(cluster, "127.0.0.1")
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer " + KEYS["tenant-a"].encode() + b"\r\ncontent-length: 1000\r\n\r\n"
                 b'{"model": "x')
    await writer.drain()
    return reader, writer


class TestSlowBody:
    async def test_stalled_bodies_are_answered_408_and_closed(self, secure_cluster: LocalCluster) -> None:
        connections = [await stalled_body(secure_cluster) for _ in range(SLOWLORIS)]
        sent = time.monotonic()
        try:
            answers = await asyncio.wait_for(asyncio.gather(*(r.read() for r, _ in connections)),
                                             BODY_IDLE_S + 5)  # read() returns at EOF: the gateway closed
        finally:
            for _, writer in connections:
                writer.close()
        assert time.monotonic() - sent >= BODY_IDLE_S - 1  # the limit, not an early refusal
        assert all(a.startswith(b"HTTP/1.1 408") and b"request_timeout" in a for a in answers), answers[:1]


class TestConnectionsPerClient:
    async def test_the_65th_connection_of_one_address_is_refused_others_are_served(
            self, secure_cluster: LocalCluster) -> None:
        held = [await open_from(secure_cluster, "127.0.0.1") for _ in range(PER_CLIENT)]
        try:
            reader, writer = await open_from(secure_cluster, "127.0.0.1")
            refusal = await asyncio.wait_for(reader.read(), 10)  # EOF: closed at once
            writer.close()
            assert refusal.startswith(b"HTTP/1.1 503"), refusal
            transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
            async with httpx.AsyncClient(base_url=secure_cluster.url, transport=transport, timeout=30) as other:
                assert (await other.get("/health")).status_code == 200
            reader, writer = held[0]
            writer.write(b"GET /health HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n\r\n")
            assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 200")  # held ones still serve
        finally:
            for _, w in held:
                w.close()
        for _ in range(100):  # closed connections give their places back
            async with httpx.AsyncClient(base_url=secure_cluster.url, timeout=10) as http:
                try:
                    if (await http.get("/health")).status_code == 200:
                        return
                except httpx.RemoteProtocolError:
                    pass
            await asyncio.sleep(0.1)
        raise AssertionError("the address's connections were not released")
