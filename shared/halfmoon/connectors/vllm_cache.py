"""Where a vLLM CPU paged cache keeps each token's K and V, and what the connector's scheduler side tells its
worker side each step: the parts of the Halfmoon connector (connectors/vllm.py) that are neither of its sides."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from halfmoon.protocol.work import BlockLocation


def slots(block_ids: list[int], block_size: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(vLLM block, offset in it) of each token position in ``[start, end)`` of a request."""
    positions = torch.arange(start, end)
    return torch.tensor(block_ids, dtype=torch.long)[positions // block_size], positions % block_size


def cache_write_layout(dtype: torch.dtype, num_kv_heads: int, block_size: int, head_dim: int) -> torch.Tensor:
    """``[2, block size, kv heads, head dim]``: where in a vLLM CPU cache block (flattened) its cache-write
    kernel puts K and V of each (token offset, head, dim). The block interior depends on the kernel's ISA
    (the ``vec`` kernels keep each head's K transposed, dim-major, and its V token-major), so it is
    learned from the kernel itself, which writes each coordinate as a value, rather than assumed."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim, "auto")
    shape = (block_size, num_kv_heads, head_dim)
    offsets = torch.full((2, *shape), -1, dtype=torch.long)
    for part in (0, 1):  # K, V
        coordinates = []
        for grid in torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij"):
            code = grid.to(dtype)
            if not torch.equal(code.to(torch.long), grid):
                raise ValueError(f"HalfmoonConnector: {dtype} cannot hold the coordinates that probe vLLM's "
                                 f"{isa} KV layout")
            cache = torch.full((1, num_kv_heads, block_size, 2 * head_dim), -1.0, dtype=dtype)
            key_cache, value_cache = cache.view(1, num_kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
            other = torch.full(shape, -2.0, dtype=dtype)  # the part not probed: told apart from the probed one
            key, value = (code, other) if part == 0 else (other, code)
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(block_size), isa)
            coordinates.append(cache.flatten().to(torch.long))
        where = (coordinates[0] >= 0).nonzero().flatten()
        token, head, dim = (c[where] for c in coordinates)
        offsets[part, token, head, dim] = where
    if (offsets < 0).any() or offsets.unique().numel() != offsets.numel():
        raise ValueError(f"HalfmoonConnector: vLLM's {isa} cache-write kernel does not put each K and V element "
                         "of a block in a place of its own; this connector cannot map its blocks")
    return offsets


@dataclass
class LoadSpec:
    """Tokens ``[start, end)`` of a request come from the pool blocks ``replicas`` (the first is block
    ``first_block`` of the prompt) into the request's vLLM blocks ``block_ids``."""

    request_id: str
    block_ids: list[int]
    start: int
    end: int
    first_block: int
    replicas: list[BlockLocation]
    trace: dict[str, str]  # the request's trace context (traceparent): the load's spans join its trace


@dataclass
class SaveSpec:
    """Blocks ``first_block ..`` (keys ``keys``) of a request were completed by this step: store them, before
    the step ends when ``wait`` (a prompt's: a decode instance or another server may look them up next),
    else in the background (generated ones)."""

    request_id: str
    block_ids: list[int]
    first_block: int
    keys: list[bytes]
    trace: dict[str, str]
    wait: bool = True


@dataclass
class HalfmoonConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


