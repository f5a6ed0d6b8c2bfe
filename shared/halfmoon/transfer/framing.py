"""Wire format of the block data plane.

A message is ``u32 little-endian header length | msgpack header | payload bytes``. The header
lists the payload sizes, so the receiver can read every payload straight into a buffer it
allocated up front (no intermediate copies). Headers are small and the same for every
transport; only TCP sends payloads inline, the shared-memory path sends headers alone.
"""

from __future__ import annotations

import enum
import struct

import msgspec

LEN = struct.Struct("<I")
MAX_KEYS = 4096  # blocks per request
# A header describes blocks, it never carries them: 4096 keys with their capabilities (~140 bytes
# each) fit in 1 MiB. The length prefix is checked before anything is allocated.
MAX_HEADER = 1 << 20
PREAUTH_HEADER = 256  # before the handshake succeeded only AUTH frames are accepted
MISSING = -1  # size of a block the node does not hold


class Op(enum.IntEnum):
    HELLO = 0  # -> segment name, host identity (decides the same-host fast path), offered paths
    READ = 1  # keys -> sizes, then payloads inline
    WRITE = 2  # keys, sizes (+ DRAM offsets, tier), payloads inline -> ack
    LOCATE = 3  # keys -> DRAM offsets and sizes (same-host reads)
    RESERVE = 4  # keys, sizes (+ offsets) -> DRAM offsets to write in place (same-host writes)
    COMMIT = 5  # keys -> make in-place writes visible
    DELETE = 6  # keys -> how many were present
    INVENTORY = 7  # -> every stored block (key, tier, offset, size); the cache-manager's LIST capability
    AUTH = 8  # the connection's handshake (transfer/auth.py); every other op needs it done
    CONNECT = 9  # the client's RDMA endpoint -> the node's, with its segment (a queue pair of its own)


class Offers(msgspec.Struct, frozen=True):
    """What a node offers beyond TCP and same-host shared memory, in its HELLO answer; each value
    is that path's connect information (decoded by the path's opener), absent when it lacks it."""

    rdma: dict | None = None  # {"device": name}; the queue pair is set up by CONNECT
    mooncake: dict | None = None  # transfer/mooncake.py MooncakeOffer

    def kinds(self) -> set[str]:
        return {k for k in ("rdma", "mooncake") if getattr(self, k) is not None}


NO_OFFERS = Offers()


class Request(msgspec.Struct, array_like=True, frozen=True):
    op: Op
    keys: list[bytes] = []
    sizes: list[int] = []
    offsets: list[int] = []  # DRAM offsets chosen by the cache-manager; empty = node chooses
    tier: int = 0
    traceparent: str = ""  # W3C trace context of the caller, so the node's span joins its trace
    caps: list[bytes] = []  # one capability per key (INVENTORY: one, node-wide); transfer/capability.py
    nonce: bytes = b""  # AUTH
    proof: bytes = b""  # AUTH
    endpoint: bytes = b""  # CONNECT: msgpack of the client's rdma.RdmaEndpoint


class Response(msgspec.Struct, array_like=True, frozen=True):
    ok: bool
    error: str = ""
    sizes: list[int] = []  # per key; MISSING where absent
    offsets: list[int] = []
    tiers: list[int] = []
    keys: list[bytes] = []
    count: int = 0
    segment: str = ""
    host: str = ""
    capacities: list[int] = []  # HELLO: bytes per tier (DRAM, NVMe, S3); 0 = tier not configured
    nonce: bytes = b""  # AUTH
    proof: bytes = b""  # AUTH
    offers: Offers = NO_OFFERS  # HELLO
    endpoint: bytes = b""  # CONNECT: msgpack of the node's rdma.RdmaEndpoint


class FramingError(Exception):
    """The peer sent something that is not a valid frame."""


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_response_decoder = msgspec.msgpack.Decoder(Response)


def encode(header: Request | Response) -> bytes:
    body = _encoder.encode(header)
    return LEN.pack(len(body)) + body


def decode_request(body: bytes) -> Request:
    try:
        return _request_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise FramingError(f"bad request header: {exc}") from None


def decode_response(body: bytes) -> Response:
    try:
        return _response_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise FramingError(f"bad response header: {exc}") from None
