"""The pool's KV block payload: a fixed header, then every layer's K and V, layer-major.

Layout (little-endian)::

    header  (HEADER.size bytes)
    layer 0: K[tokens, kv_heads, head_dim]  V[tokens, kv_heads, head_dim]
    layer 1: ...

so layer ``l`` starts at ``HEADER.size + l * layer_nbytes`` and can be read alone
(layer-wise streaming). The header carries the model fingerprint, dtype and shapes and a
CRC-32C-style checksum of the body; every reader verifies all of them.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

import torch
from halfmoon.core.errors import KVFormatError
from halfmoon.core.kv_spec import LAYOUT_VERSION as VERSION
from halfmoon.core.kv_spec import KVSpec

MAGIC = b"HMKV"
# magic, version, dtype code, layers, kv heads, head dim, tokens, fingerprint(32), crc32
HEADER = struct.Struct("<4sHBHHHH32sI")
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


class BlockLayout(NamedTuple):
    """What a block must look like for one model; readers compare against it."""

    fingerprint: bytes
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, spec: KVSpec) -> BlockLayout:
        """The payload layout of an instance's blocks (its layer range, in the spec's dtype)."""
        return cls(bytes.fromhex(spec.model_fingerprint), getattr(torch, spec.dtype),
                   spec.layers_end - spec.layer_start, spec.num_kv_heads, spec.head_dim)

    def layer_nbytes(self, num_tokens: int) -> int:
        return 2 * num_tokens * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)

    def payload_nbytes(self, num_tokens: int) -> int:
        return HEADER.size + self.num_layers * self.layer_nbytes(num_tokens)


class BlockHeader(NamedTuple):
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    fingerprint: bytes
    checksum: int


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def encode_block(layout: BlockLayout, kv: torch.Tensor) -> bytes:
    """Serialise ``kv`` shaped ``[layers, 2, tokens, kv_heads, head_dim]`` into one payload."""
    if kv.dim() != 5 or kv.shape[0] != layout.num_layers or kv.shape[1] != 2:
        raise KVFormatError(f"kv must be [layers, 2, tokens, heads, dim], got {tuple(kv.shape)}")
    body = kv.detach().to("cpu", layout.dtype).contiguous()
    raw = body.view(torch.uint8).numpy().tobytes() if body.numel() else b""
    header = HEADER.pack(
        MAGIC, VERSION, _DTYPE_CODES[layout.dtype], layout.num_layers, layout.num_kv_heads,
        layout.head_dim, int(kv.shape[2]), layout.fingerprint, zlib.crc32(raw),
    )
    return header + raw


def read_header(payload: bytes | memoryview) -> BlockHeader:
    if len(payload) < HEADER.size:
        raise KVFormatError(f"block payload too short for a header: {len(payload)} bytes")
    magic, version, code, layers, heads, dim, tokens, fingerprint, checksum = HEADER.unpack_from(payload)
    if magic != MAGIC or version != VERSION or code not in _CODE_DTYPES:
        raise KVFormatError(f"not a Halfmoon KV block (magic={magic!r}, version={version}, dtype code={code})")
    return BlockHeader(_CODE_DTYPES[code], layers, heads, dim, tokens, fingerprint, checksum)


def _checked(layout: BlockLayout, payload: bytes | memoryview) -> tuple[BlockHeader, memoryview]:
    header = read_header(payload)
    if header.fingerprint != layout.fingerprint:
        raise KVFormatError("KV block belongs to a different model (fingerprint mismatch)")
    expected = (layout.dtype, layout.num_layers, layout.num_kv_heads, layout.head_dim)
    if (header.dtype, header.num_layers, header.num_kv_heads, header.head_dim) != expected:
        raise KVFormatError(f"KV block shape/dtype {header[:4]} does not match the model's {expected}")
    body = memoryview(payload)[HEADER.size:]
    if len(body) != layout.num_layers * layout.layer_nbytes(header.num_tokens):
        raise KVFormatError(f"KV block body has {len(body)} bytes, header promises another size")
    if zlib.crc32(body) != header.checksum:
        raise KVFormatError("KV block checksum mismatch: the payload is corrupt")
    return header, body


def verify_block(layout: BlockLayout, payload: bytes | memoryview) -> bool:
    """Whether ``payload`` is an intact block of this model (what a reader checks before use)."""
    try:
        _checked(layout, payload)
    except KVFormatError:
        return False
    return True


def decode_block(layout: BlockLayout, payload: bytes | memoryview) -> torch.Tensor:
    """Verify ``payload`` against ``layout`` and its checksum; return ``[layers, 2, tokens, heads, dim]``."""
    header, body = _checked(layout, payload)
    if not len(body):
        return torch.empty(layout.num_layers, 2, 0, layout.num_kv_heads, layout.head_dim, dtype=layout.dtype)
    # A writable buffer (a fresh read) is wrapped as is; read-only bytes are copied once.
    flat = torch.frombuffer(body if not body.readonly else bytearray(body), dtype=torch.uint8)
    return flat.view(layout.dtype).view(
        layout.num_layers, 2, header.num_tokens, layout.num_kv_heads, layout.head_dim
    )
