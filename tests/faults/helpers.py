"""Looking inside a fault drill: the pool's block count, and killing the decode that holds one request."""

from __future__ import annotations

import asyncio
import json

import httpx

from halfmoon.deploy.drills import operator_nats
from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol import codecs
from halfmoon.protocol.base import Codec
from halfmoon.protocol.pool import StatsRequest
from halfmoon.protocol.stream import TokenEvent
from halfmoon.protocol.subjects import Subjects
from tests.e2e.conftest import AUTH


def pool_block_count(cluster: LocalCluster) -> int:
    async def ask() -> int:
        nc = await operator_nats(cluster)
        try:
            msg = await nc.request(Subjects(cluster.namespace).cache("stats"), Codec.encode(StatsRequest()), 5)
            return codecs.CACHE_STATS.decode(msg.data).blocks
        finally:
            await nc.close()

    return asyncio.run(ask())


def kill_holder_mid_stream(cluster: LocalCluster, body: dict, at_index: int = 24) -> dict:
    """Stream ``body``; once its decode instance has streamed index ``at_index``, SIGKILL that instance.
    Returns the text the client got, its completion token count and the instance killed (restart it after)."""

    async def run() -> dict:
        nc = await operator_nats(cluster)
        holder: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        wanted: dict[str, str] = {}

        async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
            event = codecs.STREAM.decode(msg.data)
            if (isinstance(event, TokenEvent) and event.request_id == wanted.get("id") and event.index >= at_index
                    and event.instance_id.startswith("decode") and not holder.done()):
                cluster.kill(event.instance_id)
                holder.set_result(event.instance_id)

        await nc.subscribe(f"{Subjects(cluster.namespace).root}.stream.>", cb=on_event)
        await nc.flush()
        text, usage = [], {}
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120, headers=AUTH) as http, \
                http.stream("POST", "/v1/completions", json=stream_body) as response:
            assert response.status_code == 200, await response.aread()
            wanted["id"] = response.headers["x-request-id"]
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                text.extend(c["text"] for c in chunk["choices"])
                usage = chunk.get("usage") or usage
        await nc.close()
        assert holder.done(), "the request finished before its decode instance could be killed"
        return {"text": "".join(text), "tokens": usage["completion_tokens"], "killed": holder.result()}

    return asyncio.run(run())
