"""A separate process that either starts a trace and sends it over NATS, or continues one.

usage: python tests/telemetry/trace_peer.py send|recv NATS_URL SUBJECT TRACE_FILE
``recv`` prints "ready" once subscribed and exits after continuing one message's trace.
"""

from __future__ import annotations

import asyncio
import sys

import nats

from halfmoon.telemetry import extract_context, inject_headers, setup_tracing


async def main(mode: str, url: str, subject: str, trace_file: str) -> None:
    provider = setup_tracing(f"peer-{mode}", f"{mode}-0", trace_file=trace_file, env={})
    tracer = provider.get_tracer("trace_peer")
    nc = await nats.connect(url)
    if mode == "send":
        with tracer.start_as_current_span("peer.send") as span:
            span.set_attribute("hop", 1)
            await nc.publish(subject, b"hello", headers=inject_headers())
            await nc.flush()
    else:
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_message(msg) -> None:
            if not got.done():
                got.set_result(msg)

        await nc.subscribe(subject, cb=on_message)
        await nc.flush()
        print("ready", flush=True)
        msg = await asyncio.wait_for(got, 30)
        with tracer.start_as_current_span("peer.recv", context=extract_context(msg.headers)):
            pass
    await nc.close()
    provider.shutdown()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
