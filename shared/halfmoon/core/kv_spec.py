"""The KV identity of an engine instance, advertised in its heartbeat.

Everything that must agree for two instances to share KV blocks is here: the model fingerprint
(weights and dtype), the block size, the dtype and shapes of one token's KV, the block payload's
layout version and the range of layers the instance holds (a pipeline stage holds a slice). The
conductor and the cache-manager learn it from heartbeats; nothing outside an engine loads the model.
"""

from __future__ import annotations

import msgspec

from halfmoon.core.keys import BlockHasher, Namespace

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Version of the block payload layout (core/block_format.py); bumped with the format.
LAYOUT_VERSION = 2  # 2: per-layer MACs bound to the block key (was one CRC-32)


class KVSpecMismatch(ValueError):
    """Two instances disagree on the KV identity: their blocks must never be mixed."""


class KVSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one block key and one block payload mean for this instance.

    ``layer_end`` is exclusive; a whole-model instance holds ``[0, num_layers)``.
    """

    model_fingerprint: str
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_start: int = 0
    layer_end: int = 0  # 0: every layer
    layout_version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must not be empty")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if min(self.block_size, self.num_layers, self.num_kv_heads, self.head_dim) < 1:
            raise ValueError("block_size, num_layers, num_kv_heads and head_dim must be >= 1")
        if not 0 <= self.layer_start < self.layers_end <= self.num_layers:
            raise ValueError(f"layer range [{self.layer_start}, {self.layers_end}) is outside 0..{self.num_layers}")

    @property
    def layers_end(self) -> int:
        return self.layer_end or self.num_layers

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across the layers this instance holds."""
        layers = self.layers_end - self.layer_start
        return 2 * layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def hasher(self, cache_salt: str | None = None) -> BlockHasher:
        """Block keys of this model, within one tenant's salt."""
        return BlockHasher(self.block_size, Namespace(self.model_fingerprint, cache_salt))

    def shares_blocks_with(self, other: KVSpec) -> bool:
        """Whether blocks one writes are blocks the other can read: everything but the layer range agrees."""
        return msgspec.structs.replace(self, layer_start=0, layer_end=0) == msgspec.structs.replace(
            other, layer_start=0, layer_end=0)

    def check_shares_blocks_with(self, other: KVSpec, who: str) -> None:
        if not self.shares_blocks_with(other):
            raise KVSpecMismatch(f"{who} advertises KV {describe(other)}, but this deployment uses {describe(self)}")


def describe(spec: KVSpec) -> str:
    return (f"model {spec.model_fingerprint[:12]} {spec.dtype} block_size={spec.block_size} "
            f"layers={spec.num_layers} kv_heads={spec.num_kv_heads} head_dim={spec.head_dim} "
            f"layout v{spec.layout_version}")
