"""Capabilities: what one holder may do to one block on one transfer node, until when.

A capability is a msgpack ``Capability`` followed by a 16-byte keyed-BLAKE2b tag (BLAKE2's keyed
mode is a MAC by design, and hashlib runs it on ~100 bytes in well under a microsecond, where
``hmac.digest`` costs several: a lookup signs one per replica). The
cache-manager signs them with the cluster's grant key in its put_start and lookup answers and
its tiering orders; a node checks them locally, without a round trip. A worker signs *park*
capabilities with the park key for its own hand-off blocks (parked on NVMe when the pool has
no room or no answer): those are only valid for the key ``handoff_key(request_id, index)``,
so they can never touch a content-keyed block or a DRAM extent the cache-manager placed.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import time
from collections.abc import Sequence

import msgspec

from halfmoon.core.keys import handoff_key
from halfmoon.transfer.framing import Op, Request

TAG_BYTES = 16
ANY = -1  # tier/offset/size not bound (reads name a key, not where it lives)


class Right(enum.IntFlag):
    READ = 1  # READ, LOCATE
    WRITE = 2  # WRITE, RESERVE, COMMIT
    DELETE = 4
    LIST = 8  # INVENTORY (the key is ignored)
    ORDER = 16  # run a tiering order (demote, promote, replicate, free)


class Capability(msgspec.Struct, array_like=True, frozen=True):
    rights: int
    node: str  # the node id it is valid on
    key: bytes
    expires: float  # unix time
    tier: int = ANY
    offset: int = ANY
    size: int = ANY
    request_id: str = ""  # park capabilities: ``key`` must be handoff_key(request_id, index)
    index: int = ANY


class CapabilityError(PermissionError):
    """The capability is missing, forged, expired or does not cover the request."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Capability)


def _tag(key: bytes, body: bytes) -> bytes:
    return hashlib.blake2b(body, key=key, digest_size=TAG_BYTES, person=b"halfmoon-cap").digest()


def sign(signing_key: bytes, cap: Capability) -> bytes:
    body = _encoder.encode(cap)
    return body + _tag(signing_key, body)


def sign_park(park_key: bytes, node: str, request_id: str, index: int, ttl_s: float) -> bytes:
    """A worker's capability to write, read and delete one of its hand-off blocks on ``node``'s NVMe."""
    return sign(park_key, Capability(int(Right.READ | Right.WRITE | Right.DELETE), node,
                                     handoff_key(request_id, index), time.time() + ttl_s, tier=1,
                                     request_id=request_id, index=index))


class CapabilityChecker:
    """A node's check of the capabilities that come with each request.

    Tokens whose signature checked out are remembered (the newest ``remembered`` of them): a
    token presented again (COMMIT after its RESERVE, a read capability the cache-manager reuses)
    skips decoding and the MAC, never the checks of expiry, node, rights, key and extent."""

    def __init__(self, node: str, grant_key: bytes, park_key: bytes, remembered: int = 16384) -> None:
        self.node = node
        self._grant, self._park = grant_key, park_key
        self._verified: dict[bytes, Capability] = {}  # token -> its capability, oldest first
        self._remembered = remembered

    def _authentic(self, token: bytes) -> Capability:
        cap = self._verified.get(token)
        if cap is not None:
            return cap
        if len(token) <= TAG_BYTES:
            raise CapabilityError("no capability")
        body, tag = token[:-TAG_BYTES], token[-TAG_BYTES:]
        try:
            cap = _decoder.decode(body)
        except msgspec.DecodeError:
            raise CapabilityError("malformed capability") from None
        signer = self._park if cap.request_id else self._grant
        if not hmac.compare_digest(tag, _tag(signer, body)):
            raise CapabilityError("capability signature invalid")
        if cap.request_id and (cap.index < 0 or cap.key != handoff_key(cap.request_id, cap.index) or cap.tier != 1):
            raise CapabilityError("park capability for a key that is not the request's hand-off block")
        if len(self._verified) >= self._remembered:
            del self._verified[next(iter(self._verified))]
        self._verified[token] = cap
        return cap

    def check(self, token: bytes, right: Right, key: bytes | None, *, tier: int = ANY, offset: int = ANY,
              size: int = ANY, now: float | None = None) -> Capability:
        """The capability in ``token`` if it grants ``right`` on ``key`` (``None``: node-wide) on this
        node now, at the ``tier``/``offset``/``size`` the request names (``ANY``: it names none, e.g.
        the node chooses the offset); ``CapabilityError`` otherwise."""
        cap = self._authentic(token)
        if cap.expires < (time.time() if now is None else now):
            raise CapabilityError("capability expired")
        if cap.node != self.node:
            raise CapabilityError("capability is for another node")
        if not cap.rights & right.value:  # NOTE: ints: IntFlag arithmetic costs microseconds per block
            raise CapabilityError(f"capability does not grant {right.name}")
        if key is not None and cap.key != key:
            raise CapabilityError("capability is for another key")
        for name, bound, want in (("tier", cap.tier, tier), ("offset", cap.offset, offset), ("size", cap.size, size)):
            if ANY not in (bound, want) and want != bound:  # what the request names must match
                raise CapabilityError(f"capability is for {name} {bound}, request has {want}")
        return cap

    def check_all(self, tokens: Sequence[bytes], right: Right, keys: Sequence[bytes], *,
                  tier: int = ANY, offsets: Sequence[int] = (), sizes: Sequence[int] = ()) -> None:
        if len(tokens) != len(keys):
            raise CapabilityError(f"{len(keys)} keys but {len(tokens)} capabilities")
        now = time.time()
        for i, (token, key) in enumerate(zip(tokens, keys)):
            self.check(token, right, key, tier=tier, offset=offsets[i] if offsets else ANY,
                       size=sizes[i] if sizes else ANY, now=now)


def authorize(checker: CapabilityChecker, req: Request) -> None:
    """Raise ``CapabilityError`` unless ``req``'s capabilities cover every key it names, before
    the node reads a payload byte or allocates anything for it."""
    op = req.op
    if op in (Op.HELLO, Op.CONNECT):
        # the handshake is enough to learn the node's segment and capacities, and to reach the segment
        # one-sided (as same-host clients map it): the MAC sealed into each block guards what is read
        return
    if op is Op.INVENTORY:
        checker.check(req.caps[0] if req.caps else b"", Right.LIST, None)
        return
    if op in (Op.READ, Op.LOCATE):
        checker.check_all(req.caps, Right.READ, req.keys)
    elif op is Op.DELETE:
        checker.check_all(req.caps, Right.DELETE, req.keys)
    elif op in (Op.WRITE, Op.RESERVE, Op.COMMIT):
        dram = req.tier == 0
        checker.check_all(req.caps, Right.WRITE, req.keys, tier=req.tier if op is Op.WRITE else 0,
                          offsets=req.offsets if dram else (), sizes=req.sizes)
    else:
        raise CapabilityError(f"{op.name} is not a block operation")
