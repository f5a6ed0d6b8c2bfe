"""The pool's KV block payload: a header, then every layer's K and V, layer-major.

Layout (little-endian)::

    fixed header  (FIXED.size bytes: magic, version, dtype, shapes, fingerprint, salt)
    layer tags    (TAG_BYTES per layer)
    layer 0: K[tokens, kv_heads, head_dim]  V[tokens, kv_heads, head_dim]
    layer 1: ...

so layer ``l`` starts at ``layout.header_nbytes + l * layer_nbytes`` and can be read and
verified alone (layer-wise streaming). Each layer carries a MAC keyed by the cluster's KV key
and bound to the block's key, the fixed header and the layer index: a block written by anyone
without the key, or copied under another key, fails verification and is recomputed, never used.

The MAC is AES-256-GMAC (GCM with no plaintext) under a per-block key: BLAKE2b keyed with the
cluster's KV key over (block key, fixed header with a random 16-byte salt). Why GMAC rather
than HMAC or keyed BLAKE2b: it runs at memory speed with AES-NI/PCLMUL (tens of GB/s against
~0.1-1 GB/s), so verifying costs far less than moving the block; the per-block key makes the
nonce (the layer index) unique per key, which GCM requires.

``encode_block`` without a key leaves the salt and tags zero (unsealed): the engine exports
blocks before anyone chose their keys, and the writer seals each with ``seal_block`` under the
key it stores it as.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from halfmoon.core.cluster_keys import DEV_KEYS
from halfmoon.core.errors import KVFormatError
from halfmoon.core.kv_spec import LAYOUT_VERSION as VERSION
from halfmoon.core.kv_spec import KVSpec

MAGIC = b"HMKV"
# magic, version, dtype code, layers, kv heads, head dim, tokens, fingerprint(32), salt(16)
FIXED = struct.Struct("<4sHBHHHH32s16s")
TAG_BYTES = 16
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
Payload = bytes | bytearray | memoryview


class BlockLayout(NamedTuple):
    """What a block must look like for one model, and the key its MACs are checked with."""

    fingerprint: bytes
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    mac_key: bytes = DEV_KEYS.kv_mac

    @classmethod
    def of(cls, spec: KVSpec) -> BlockLayout:
        """The payload layout of an instance's blocks (its layer range, in the spec's dtype)."""
        return cls(bytes.fromhex(spec.model_fingerprint), getattr(torch, spec.dtype),
                   spec.layers_end - spec.layer_start, spec.num_kv_heads, spec.head_dim)

    def keyed(self, mac_key: bytes) -> BlockLayout:
        return self._replace(mac_key=mac_key)

    @property
    def header_nbytes(self) -> int:
        return FIXED.size + TAG_BYTES * self.num_layers

    def layer_nbytes(self, num_tokens: int) -> int:
        return 2 * num_tokens * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)

    def payload_nbytes(self, num_tokens: int) -> int:
        return self.header_nbytes + self.num_layers * self.layer_nbytes(num_tokens)

    def __repr__(self) -> str:  # NOTE: never print the MAC key
        return (f"BlockLayout({self.fingerprint.hex()[:12]}, {self.dtype}, layers={self.num_layers}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim})")


class BlockHeader(NamedTuple):
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    fingerprint: bytes


_ITEMSIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def _itemsize(dtype: torch.dtype) -> int:
    return _ITEMSIZE[dtype]  # NOTE: a table, not torch.empty(): this runs once per layer per block


def encode_block(layout: BlockLayout, kv: torch.Tensor, key: bytes | None = None) -> bytearray:
    """Serialise ``kv`` shaped ``[layers, 2, tokens, kv_heads, head_dim]``; sealed under ``key`` if given."""
    if kv.dim() != 5 or kv.shape[0] != layout.num_layers or kv.shape[1] != 2:
        raise KVFormatError(f"kv must be [layers, 2, tokens, heads, dim], got {tuple(kv.shape)}")
    body = kv.detach().to("cpu", layout.dtype).contiguous()
    out = blank_block(layout, int(kv.shape[2]))
    if body.numel():
        memoryview(out)[layout.header_nbytes:] = body.view(torch.uint8).reshape(-1).numpy().data
    return seal_block(layout, out, key) if key is not None else out


def blank_block(layout: BlockLayout, num_tokens: int) -> bytearray:
    """An unsealed block of ``num_tokens`` tokens with zero KV: a layer-wise writer fills it layer by layer."""
    out = bytearray(layout.payload_nbytes(num_tokens))
    FIXED.pack_into(out, 0, MAGIC, VERSION, _DTYPE_CODES[layout.dtype], layout.num_layers, layout.num_kv_heads,
                    layout.head_dim, num_tokens, layout.fingerprint, bytes(16))
    return out


def read_header(payload: Payload) -> BlockHeader:
    if len(payload) < FIXED.size:
        raise KVFormatError(f"block payload too short for a header: {len(payload)} bytes")
    magic, version, code, layers, heads, dim, tokens, fingerprint, _salt = FIXED.unpack_from(payload)
    if magic != MAGIC or version != VERSION or code not in _CODE_DTYPES:
        raise KVFormatError(f"not a Halfmoon KV block (magic={magic!r}, version={version}, dtype code={code})")
    return BlockHeader(_CODE_DTYPES[code], layers, heads, dim, tokens, fingerprint)


def _checked(layout: BlockLayout, payload: Payload, layers: int | None = None) -> BlockHeader:
    """The header, after checking it and the size against ``layout`` (no MAC): the whole block,
    or only its first ``layers`` layers (a block streamed layer by layer)."""
    header = read_header(payload)
    if header.fingerprint != layout.fingerprint:
        raise KVFormatError("KV block belongs to a different model (fingerprint mismatch)")
    expected = (layout.dtype, layout.num_layers, layout.num_kv_heads, layout.head_dim)
    if (header.dtype, header.num_layers, header.num_kv_heads, header.head_dim) != expected:
        raise KVFormatError(f"KV block shape/dtype {header[:4]} does not match the model's {expected}")
    full = layout.payload_nbytes(header.num_tokens)
    least = full if layers is None else layout.header_nbytes + layers * layout.layer_nbytes(header.num_tokens)
    if not least <= len(payload) <= full or (layers is None and len(payload) != full):
        raise KVFormatError(f"KV block has {len(payload)} bytes, its header promises another size")
    return header


def _block_mac(layout: BlockLayout, payload: Payload, key: bytes) -> AESGCM:
    if len(key) != 32:
        raise ValueError("block keys are 32 bytes")
    subkey = hashlib.blake2b(key + bytes(memoryview(payload)[: FIXED.size]), key=layout.mac_key, digest_size=32)
    return AESGCM(subkey.digest())


def _tags(layout: BlockLayout, payload: Payload, key: bytes, num_tokens: int, layers: range) -> list[bytes]:
    """The MAC of each layer in ``layers``, computed over that layer's bytes in place."""
    mac = _block_mac(layout, payload, key)
    size, base, view = layout.layer_nbytes(num_tokens), layout.header_nbytes, memoryview(payload)
    return [mac.encrypt(layer.to_bytes(12, "little"), b"", view[base + layer * size : base + (layer + 1) * size])
            for layer in layers]


WritableBlock = TypeVar("WritableBlock", bytearray, memoryview)  # sealed in place, returned as given


def seal_block(layout: BlockLayout, payload: WritableBlock, key: bytes) -> WritableBlock:
    """Give ``payload`` (writable) a fresh salt and the MAC of every layer under ``key``, in place."""
    _checked(layout, payload)
    salt_block(payload)
    seal_layers(layout, payload, key, range(layout.num_layers))
    return payload


def salt_block(payload: bytearray | memoryview, salt: bytes | None = None) -> bytes:
    """A fresh salt (or ``salt``: writers sealing different layers of one block share it) in ``payload``'s
    header: first step of sealing, before any layer's MAC. Returns it."""
    salt = os.urandom(16) if salt is None else salt
    if len(salt) != 16:
        raise ValueError(f"a block's salt is 16 bytes, got {len(salt)}")
    memoryview(payload)[FIXED.size - 16 : FIXED.size] = salt
    return salt


def seal_layers(layout: BlockLayout, payload: bytearray | memoryview, key: bytes, layers: range) -> None:
    """The MACs of ``layers`` under ``key``, in place, after ``salt_block`` (a layer-wise writer seals
    each layer as it is computed; ``payload`` may end after ``layers``)."""
    header = _checked(layout, payload, layers.stop if layers.stop < layout.num_layers else None)
    memoryview(payload)[FIXED.size + layers.start * TAG_BYTES : FIXED.size + layers.stop * TAG_BYTES] = b"".join(
        _tags(layout, payload, key, header.num_tokens, layers))


def _layers_intact(layout: BlockLayout, payload: Payload, key: bytes, layers: range) -> bool:
    header = _checked(layout, payload, layers.stop if layers.stop < layout.num_layers else None)
    stored = bytes(memoryview(payload)[FIXED.size + layers.start * TAG_BYTES : FIXED.size + layers.stop * TAG_BYTES])
    return hmac.compare_digest(stored, b"".join(_tags(layout, payload, key, header.num_tokens, layers)))


def verify_block(layout: BlockLayout, payload: Payload, key: bytes) -> bool:
    """Whether ``payload`` is an intact block of this model, sealed under ``key`` with the cluster's KV key."""
    try:
        return _layers_intact(layout, payload, key, range(layout.num_layers))
    except KVFormatError:
        return False


def verify_layer(layout: BlockLayout, payload: Payload, layer: int, key: bytes) -> bool:
    """Whether layer ``layer`` of ``payload`` is intact (a layer-wise reader checks only what it uses).

    ``payload`` may end after that layer: the bytes of later layers are not needed."""
    if not 0 <= layer < layout.num_layers:
        raise ValueError(f"layer {layer} is outside 0..{layout.num_layers - 1}")
    try:
        return _layers_intact(layout, payload, key, range(layer, layer + 1))
    except KVFormatError:
        return False


class LayerVerifier:
    """Checks one block layer by layer as its bytes land (a layer-wise reader). Its MAC key is
    derived once, from the salt in the header that arrives with layer 0; the payload's bytes must
    stay where they are (a preallocated buffer being filled)."""

    def __init__(self, layout: BlockLayout, payload: bytearray, key: bytes, num_tokens: int) -> None:
        self.layout, self.payload, self.key, self.num_tokens = layout, payload, key, num_tokens
        self._mac: AESGCM | None = None

    def intact(self, layer: int) -> bool:
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.layout.num_layers - 1}")
        if self._mac is None:
            try:
                if _checked(self.layout, self.payload).num_tokens != self.num_tokens:
                    return False
            except KVFormatError:
                return False
            self._mac = _block_mac(self.layout, self.payload, self.key)
        size, base, view = self.layout.layer_nbytes(self.num_tokens), self.layout.header_nbytes, memoryview(self.payload)
        tag = self._mac.encrypt(layer.to_bytes(12, "little"), b"", view[base + layer * size : base + (layer + 1) * size])
        return hmac.compare_digest(bytes(view[FIXED.size + layer * TAG_BYTES : FIXED.size + (layer + 1) * TAG_BYTES]), tag)

    def body(self) -> torch.Tensor:
        """The block's KV as ``[layers, 2, tokens, heads, dim]``, a view of the payload: layers that have
        not landed (or not passed ``intact``) hold whatever the buffer holds."""
        body = memoryview(self.payload)[self.layout.header_nbytes :]
        return _as_tensor(self.layout, body, (self.layout.num_layers, 2, self.num_tokens, self.layout.num_kv_heads,
                                              self.layout.head_dim))


def _as_tensor(layout: BlockLayout, body: memoryview, shape: tuple[int, ...]) -> torch.Tensor:
    if not len(body):
        return torch.empty(shape, dtype=layout.dtype)
    # A writable buffer (a fresh read) is wrapped as is; read-only bytes are copied once.
    flat = torch.frombuffer(body if not body.readonly else bytearray(body), dtype=torch.uint8)
    return flat.view(layout.dtype).view(shape)


def decode_block(layout: BlockLayout, payload: Payload, key: bytes | None = None) -> torch.Tensor:
    """``[layers, 2, tokens, heads, dim]`` of ``payload``, after checking it against ``layout`` and,
    given ``key``, its MACs. Without ``key`` only the shape is checked: for payloads the caller
    already verified with ``verify_block`` (the engine imports those)."""
    header = _checked(layout, payload)
    if key is not None and not _layers_intact(layout, payload, key, range(layout.num_layers)):
        raise KVFormatError("KV block MAC mismatch: the payload was altered or sealed under another key")
    body = memoryview(payload)[layout.header_nbytes :]
    return _as_tensor(layout, body, (layout.num_layers, 2, header.num_tokens, layout.num_kv_heads, layout.head_dim))


def decode_layer(layout: BlockLayout, payload: Payload, layer: int, key: bytes) -> torch.Tensor:
    """``[2, tokens, heads, dim]`` of one verified layer (``payload`` may end after it)."""
    if not verify_layer(layout, payload, layer, key):
        raise KVFormatError(f"KV block layer {layer} is corrupt, truncated or sealed under another key")
    header = read_header(payload)
    size = layout.layer_nbytes(header.num_tokens)
    start = layout.header_nbytes + layer * size
    body = memoryview(payload)[start : start + size]
    return _as_tensor(layout, body, (2, header.num_tokens, layout.num_kv_heads, layout.head_dim))


class Sealer:
    """Seals payloads in place under their keys, each key once however many writes (replicas)
    carry it. ``hook(keys)`` is a transport's ``prepare`` for one batch: each block is sealed just
    before its bytes leave, while they are in cache for the send or copy that follows."""

    def __init__(self, layout: BlockLayout) -> None:
        self.layout = layout
        self._sealed: set[bytes] = set()

    def hook(self, keys: Sequence[bytes]) -> Callable[[int, memoryview], None]:
        def seal(index: int, payload: memoryview) -> None:
            if keys[index] not in self._sealed:
                seal_block(self.layout, payload, keys[index])
                self._sealed.add(keys[index])
        return seal


class Verifier:
    """A transport's ``check`` for one batch read under ``keys``: verifies each block as it lands
    (in cache, while the next ones are in flight); ``intact[i]`` is block ``i``'s verdict."""

    def __init__(self, layout: BlockLayout, keys: Sequence[bytes]) -> None:
        self.layout, self.keys = layout, keys
        self.intact = [False] * len(keys)

    def __call__(self, index: int, view: memoryview) -> None:
        self.intact[index] = verify_block(self.layout, view, self.keys[index])
