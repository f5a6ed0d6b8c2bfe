"""Data-plane transports side by side, 16 x 1 MiB and 128 x 64 KiB batches in the same run.

Against a block server in another process (which also registers its DRAM segment with a
Mooncake engine, as a transfer node offering Mooncake would):
  * raw loopback socket (blocking sendall / recv_into of the same bytes) -> our TCP transport;
  * Mooncake's engine called directly (one batch, no control messages) -> our Mooncake transport
    over the engine's TCP path (LOCATE / RESERVE / COMMIT on the node's TCP port, bytes by the engine);
  * numpy memcpy -> the same-host shared-memory transport.
Rounds alternate baseline and ours; the table reports the best round of each (the least disturbed
on a shared machine) and the ratio of the medians. Reads land in one warm buffer, registered
(pinned) with the engine for the Mooncake rows.
Run: python -m benchmarks.transports [--rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.pool_security import grants
from benchmarks.pool_throughput import (
    Raw,
    Result,
    Step,
    key,
    measure,
    serve_until_stdin_closes,
    start_node,
)
from halfmoon.storage.segment import AttachedSegment
from halfmoon.transfer.client import TransferClient
from halfmoon.transfer.direct import DirectTransport
from halfmoon.transfer.local_memory import address_of
from halfmoon.transfer.mooncake import (
    MooncakeEngine,
    MooncakeOffer,
    MooncakePath,
    MooncakeSegment,
    MooncakeUnavailable,
)
from halfmoon.transfer.onesided import OneSidedTransport
from halfmoon.transfer.tcp import TcpTransport

SHAPES = ((16, 1 << 20), (128, 64 << 10))  # (blocks per batch, block bytes)
Case = tuple[Step, Step, str]


async def serve(batch_bytes: int) -> None:
    """The node of ``pool_throughput`` that also registers its DRAM segment with a Mooncake engine."""
    server, raw_port = await start_node(batch_bytes)
    offer = "-"
    try:
        segment = AttachedSegment(server.store.dram.segment)
        exported = MooncakeSegment(MooncakeEngine(), segment.buf)
        offer = msgspec.json.encode(exported.offer()).decode()
    except MooncakeUnavailable as exc:
        print(f"mooncake rows skipped: {exc}", file=sys.stderr)
    await serve_until_stdin_closes(server, raw_port, offer)


async def shape_cases(address: str, raw: Raw, offer: MooncakeOffer | None, engine: MooncakeEngine | None,
                      batch: int, block: int, client: TransferClient) -> tuple[dict[str, Case], list[object]]:
    nbytes = batch * block
    keys = [key(i) for i in range(batch)]
    payloads = [np.random.bytes(block) for _ in range(batch)]
    src = np.frombuffer(b"".join(payloads), dtype=np.uint8)
    dest = memoryview(bytearray(nbytes))
    dest_array = np.frombuffer(dest, dtype=np.uint8)
    shm = await client.transport(address)
    tcp = TcpTransport(address)
    caps = grants(keys)  # as a put_start / lookup answer grants them
    await tcp.write(keys, payloads, caps=caps)
    assert [bytes(v) for v in await shm.read(keys, caps=caps)] == payloads  # correctness before speed

    def memcpy() -> None:
        np.copyto(dest_array, src)

    direct = (await client.paths(address))[0].transport
    assert isinstance(direct, DirectTransport), "the node is not on this host: no shared-memory path"
    extents = await direct.locate(keys, caps)  # what a pool lookup answers with each replica

    cases: dict[str, Case] = {
        "tcp get": (lambda: tcp.read(keys, caps=caps, into=dest), lambda: raw.get(dest), "raw socket"),
        "tcp put": (lambda: tcp.write(keys, payloads, caps=caps), lambda: raw.put(payloads), "raw socket"),
        "shm get": (lambda: shm.read(keys, caps=caps, into=dest), memcpy, "memcpy"),
        "shm get (extents from a lookup)": (lambda: shm.read(keys, caps=caps, into=dest, extents=extents), memcpy,
                                            "memcpy"),
        "shm put": (lambda: shm.write(keys, payloads, caps=caps), memcpy, "memcpy"),
    }
    closers: list[object] = [tcp]
    if offer is not None and engine is not None:
        mc = OneSidedTransport(TcpTransport(address), MooncakePath(engine, offer))
        mc.pin(dest)
        assert [bytes(v) for v in await mc.read(keys, caps=caps, into=dest)] == payloads
        extents = await mc.locate(keys, caps=caps)
        local = [address_of(dest[i * block:(i + 1) * block]) for i in range(batch)]
        remote = [offer.segment_addr + e.offset for e in extents]

        def engine_get() -> None:
            engine.transfer(offer.session, False, local, remote, [block] * batch)

        def engine_put() -> None:
            engine.transfer(offer.session, True, local, remote, [block] * batch)

        pinned = [dest[i * block:(i + 1) * block] for i in range(batch)]  # payloads already in registered memory
        engine_name = "mooncake engine, one batch"
        cases |= {
            "mooncake get": (lambda: mc.read(keys, caps=caps, into=dest), engine_get, engine_name),
            "mooncake put (registered payloads)": (lambda: mc.write(keys, pinned, caps=caps), engine_put, engine_name),
            "mooncake put (staged payloads)": (lambda: mc.write(keys, payloads, caps=caps), engine_put, engine_name),
            "mooncake get (engine) vs raw socket": (engine_get, lambda: raw.get(dest), "raw socket"),
        }
        closers.append(mc)
    return cases, closers


async def run(rounds: int) -> list[tuple[str, Result]]:
    biggest = max(b * n for b, n in SHAPES)
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.transports", "--serve", str(biggest)],  # noqa: ASYNC220
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address, raw_port, offer_json = proc.stdout.readline().split()  # type: ignore[union-attr]
        offer = None if offer_json == "-" else msgspec.json.decode(offer_json, type=MooncakeOffer)
        engine = MooncakeEngine() if offer is not None else None
        raw = Raw(int(raw_port))
        client = TransferClient()
        out = []
        for batch, block in SHAPES:
            cases, closers = await shape_cases(address, raw, offer, engine, batch, block, client)
            shape = f"{batch} x {block >> 10} KiB" if block < (1 << 20) else f"{batch} x {block >> 20} MiB"
            out += [(shape, r) for r in await measure(cases, rounds, batch * block, batch)]
            for c in closers:
                await c.close()  # type: ignore[attr-defined]
        await client.close()
        raw.sock.close()
        return out
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    rows = asyncio.run(run(args.rounds))
    table = Table(title=f"Data-plane transports, best of {args.rounds} rounds (GB/s of block payload)")
    for col in ("blocks", "path", "GB/s", "baseline", "baseline GB/s", "ratio", "ratio of medians"):
        table.add_column(col, justify="left" if col in ("blocks", "path", "baseline") else "right")
    for shape, r in rows:
        ratio = f"{r.gbps / r.base_gbps:.0%}"
        table.add_row(shape, r.name, f"{r.gbps:.2f}", r.baseline, f"{r.base_gbps:.2f}", ratio, f"{r.median_ratio:.0%}")
    Console(width=160).print(table)
    print("command:", " ".join(["python -m benchmarks.transports", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
