"""Chained content keys for KVCache blocks.

A block's key commits to its whole prefix: ``key_i = SHA-256(key_{i-1} || namespace || tokens_i)``
with ``tokens_i`` the block's token ids as little-endian int32. Equal prefixes therefore give
equal key chains, and prefix matching is a walk along the chain. The namespace digest binds the
model fingerprint and the optional per-tenant cache salt, so tenants with different salts (or
different models) never share a key.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NamedTuple

KEY_BYTES = 32
ROOT_KEY = bytes(KEY_BYTES)  # parent of the first block of every chain
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class Namespace(NamedTuple):
    """What a block's key must be unique within: one model, optionally one tenant."""

    model_fingerprint: str
    cache_salt: str | None = None

    def digest(self) -> bytes:
        # Length-prefixed fields so ("ab", "c") and ("a", "bc") cannot collide, and a missing
        # salt differs from an empty one.
        h = hashlib.sha256(b"halfmoon-kv-namespace/1")
        for field in (self.model_fingerprint, self.cache_salt):
            if field is None:
                h.update(b"\xff")
                continue
            raw = field.encode("utf-8")
            h.update(b"\x00" + len(raw).to_bytes(8, "little") + raw)
        return h.digest()


class BlockHasher:
    """Turns token id sequences into chains of 32-byte block keys (only full blocks get a key)."""

    def __init__(self, block_size: int, namespace: Namespace | str) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if isinstance(namespace, str):
            namespace = Namespace(namespace)
        if not namespace.model_fingerprint:
            raise ValueError("namespace needs a non-empty model fingerprint")
        self.block_size = block_size
        self.namespace = namespace
        self._ns_digest = namespace.digest()
        self._packer = struct.Struct(f"<{block_size}i")

    def key(self, parent: bytes, block_tokens: Sequence[int]) -> bytes:
        """Key of one full block whose predecessor has key ``parent`` (``ROOT_KEY`` for the first)."""
        if len(parent) != KEY_BYTES:
            raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
        if len(block_tokens) != self.block_size:
            raise ValueError(f"a block has {self.block_size} tokens, got {len(block_tokens)}")
        try:
            packed = self._packer.pack(*block_tokens)
        except struct.error as exc:
            raise ValueError(f"token ids must be int32 ({_INT32_MIN}..{_INT32_MAX}): {exc}") from None
        return hashlib.sha256(parent + self._ns_digest + packed).digest()

    def keys(self, token_ids: Sequence[int], parent: bytes = ROOT_KEY) -> list[bytes]:
        """Keys of every full block of ``token_ids``; a trailing partial block gets none."""
        out: list[bytes] = []
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = self.key(parent, token_ids[start : start + bs])
            out.append(parent)
        return out


def key_hex(key: bytes) -> str:
    """Short printable form of a key for logs."""
    return key.hex()[:16]


def handoff_key(request_id: str, index: int) -> bytes:
    """Key of a scratch KV block moving from prefill to decode (not a content key: never shared)."""
    return hashlib.sha256(f"handoff/{request_id}/{index}".encode()).digest()
