"""Mutual challenge-response on every data-plane connection, keyed by the cluster secret.

    peer -> node   AUTH nonce=Np                        (fresh 32 random bytes)
    node -> peer   ok nonce=Nn proof=H(K, "node"|Np|Nn) (the node knows the secret)
    peer -> node   AUTH proof=H(K, "peer"|Nn|Np)         (the peer knows the secret)
    node -> peer   ok | refusal, then close

H is HMAC-SHA256 under the cluster's handshake key. Each side's proof covers the other's fresh
nonce, so a recorded proof is useless on another connection (no replay either way), and the
role labels keep a node's proof from passing as a peer's. A node serves nothing, not even the
name of its shared-memory segment, before the last step succeeded.
"""

from __future__ import annotations

import asyncio
import hmac
import os

from halfmoon.transfer.channel import Channel
from halfmoon.transfer.framing import (
    PREAUTH_HEADER,
    Op,
    Request,
    Response,
    decode_request,
    decode_response,
)

NONCE_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0


class AuthError(ConnectionError):
    """The other side does not know the cluster secret (or spoke out of turn)."""


def _proof(key: bytes, role: bytes, theirs: bytes, ours: bytes) -> bytes:
    return hmac.digest(key, role + theirs + ours, "sha256")


async def authenticate_to_node(ch: Channel, key: bytes) -> None:
    """The peer's side; raises ``AuthError`` when the node refuses or cannot prove itself."""
    mine = os.urandom(NONCE_BYTES)
    await ch.send(Request(Op.AUTH, nonce=mine))
    hello = decode_response(await ch.recv_header(PREAUTH_HEADER))
    if not hello.ok or len(hello.nonce) != NONCE_BYTES:
        raise AuthError(f"node refused the connection: {hello.error or 'no challenge'}")
    if not hmac.compare_digest(hello.proof, _proof(key, b"node", mine, hello.nonce)):
        raise AuthError("node failed to prove it knows the cluster secret")
    await ch.send(Request(Op.AUTH, proof=_proof(key, b"peer", hello.nonce, mine)))
    done = decode_response(await ch.recv_header(PREAUTH_HEADER))
    if not done.ok:
        raise AuthError(f"node refused the connection: {done.error}")


async def authenticate_peer(ch: Channel, key: bytes) -> None:
    """The node's side; raises ``AuthError`` after sending the peer a refusal."""
    async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
        first = decode_request(await ch.recv_header(PREAUTH_HEADER))
        if first.op is not Op.AUTH or len(first.nonce) != NONCE_BYTES:
            await ch.send(Response(False, error="unauthenticated: the first message must be AUTH"))
            raise AuthError(f"peer sent {first.op.name} before authenticating")
        mine = os.urandom(NONCE_BYTES)
        await ch.send(Response(True, nonce=mine, proof=_proof(key, b"node", first.nonce, mine)))
        second = decode_request(await ch.recv_header(PREAUTH_HEADER))
        if second.op is not Op.AUTH or not hmac.compare_digest(second.proof, _proof(key, b"peer", mine, first.nonce)):
            await ch.send(Response(False, error="unauthenticated: wrong cluster secret"))
            raise AuthError("peer failed to prove it knows the cluster secret")
        await ch.send(Response(True))
