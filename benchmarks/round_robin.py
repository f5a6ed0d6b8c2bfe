"""A round-robin HTTP proxy in front of several OpenAI-compatible servers, as a Kubernetes Service spreads
requests over its pods: each completion goes to the next server in turn, whatever its prompt.

    python -m benchmarks.round_robin --port PORT --upstream http://127.0.0.1:A --upstream http://127.0.0.1:B

Bodies and streamed replies pass through unchanged; ``GET`` requests (``/v1/models``, ``/health``) go to
the first server. `benchmarks.peers` puts it in front of two vLLM servers (``vllm-pair``,
``vllm-pair-pool``) so that aiperf sees one endpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"})


def app(upstreams: list[str]) -> Starlette:
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10), limits=httpx.Limits(max_connections=None))
    turns: Iterator[str] = itertools.cycle(upstreams)

    async def forward(request: Request) -> StreamingResponse:
        upstream = next(turns) if request.method == "POST" else upstreams[0]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        sent = client.build_request(request.method, upstream + request.url.path, params=request.query_params,
                                    headers=headers, content=await request.body())
        reply = await client.send(sent, stream=True)
        return StreamingResponse(reply.aiter_raw(), status_code=reply.status_code,
                                 headers={k: v for k, v in reply.headers.items() if k.lower() not in HOP_BY_HOP},
                                 background=BackgroundTask(reply.aclose))

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])], lifespan=lifespan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", action="append", required=True, help="a server's base URL (repeat)")
    args = parser.parse_args()
    uvicorn.run(app([u.rstrip("/") for u in args.upstream]), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
