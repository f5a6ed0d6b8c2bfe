"""vLLM's prefix cache as the block keys the conductor indexes: vLLM's KV cache events (blocks of vLLM's own
size, chained by vLLM's own hashes) turned into Halfmoon's chained keys of the pool-sized blocks they hold,
so that the conductor places a prompt where vLLM holds its prefix, as it does for Halfmoon's engine.

vLLM salts a request's first block with the request's first pool key (engine/vllm_engine.py), and that
salt names the chain; the tenant salt the key was made under is the one of the request that was given the
key (``expect``). A chain whose first key this process never handed out (a restart in between, or more
first blocks than it remembers) is left out, and so is a block whose keys do not recompute to that first
key: what the conductor does not know is a miss, never a wrong hit. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from halfmoon.core.keys import ROOT_KEY, BlockHasher

REMEMBERED_FIRST_KEYS = 65536


class _Block(NamedTuple):
    hasher: BlockHasher  # of its chain's tenant
    keys: list[bytes]  # the pool blocks it holds, in order


class PrefixCacheKeys:
    """Contract: ``expect`` each request's first pool key before vLLM may cache its blocks; feed every event
    in the order vLLM published it (``stored``, ``removed``, ``cleared``); ``take`` returns the keys stored
    and evicted since the last ``take``, and ``held`` every key vLLM holds now (for a snapshot)."""

    def __init__(self, hasher_of: Callable[[str | None], BlockHasher], remember: int = REMEMBERED_FIRST_KEYS) -> None:
        self._hasher_of = hasher_of
        self._remember = remember
        self._tenants: OrderedDict[str, str | None] = OrderedDict()  # first key (hex) -> its tenant salt
        self._hashers: dict[str | None, BlockHasher] = {}
        self._blocks: dict[Hashable, _Block] = {}  # vLLM's block hash -> what it holds
        self._stored: list[bytes] = []
        self._evicted: list[bytes] = []

    def expect(self, first_key: bytes, tenant_salt: str | None) -> None:
        name = first_key.hex()
        self._tenants[name] = tenant_salt
        self._tenants.move_to_end(name)
        while len(self._tenants) > self._remember:
            self._tenants.popitem(last=False)

    def stored(self, block_hashes: Sequence[Hashable], parent: Hashable | None, token_ids: Sequence[int],
               block_size: int, extra_keys: Sequence[tuple[Any, ...] | None] | None) -> None:
        """vLLM cached ``block_hashes`` (consecutive blocks of one chain, ``block_size`` tokens each, after
        ``parent``); ``extra_keys`` per block, the first block's carrying its cache salt."""
        for n, block in enumerate(block_hashes):
            tokens = token_ids[n * block_size:(n + 1) * block_size]
            before = parent if n == 0 else block_hashes[n - 1]
            if before is None:
                found = self._chain_root(extra_keys[n] if extra_keys else None)
                if found is None:
                    continue
                hasher, first = found
                keys = hasher.keys(tokens, ROOT_KEY)
                if not keys or keys[0] != first:
                    continue
            else:
                earlier = self._blocks.get(before)
                if earlier is None:
                    continue
                hasher = earlier.hasher
                keys = hasher.keys(tokens, earlier.keys[-1])
            if len(keys) * hasher.block_size != len(tokens):  # a vLLM block that is no whole number of pool blocks
                continue
            self._blocks[block] = _Block(hasher, keys)
            self._stored.extend(keys)

    def _chain_root(self, extra: tuple[Any, ...] | None) -> tuple[BlockHasher, bytes] | None:
        """The hasher of a first block's tenant and the first key, from the cache salt among its extra keys."""
        for value in extra or ():
            if isinstance(value, str) and value in self._tenants:
                tenant = self._tenants[value]
                hasher = self._hashers.get(tenant)
                if hasher is None:
                    hasher = self._hashers[tenant] = self._hasher_of(tenant)
                return hasher, bytes.fromhex(value)
        return None

    def removed(self, block_hashes: Sequence[Hashable]) -> None:
        for block in block_hashes:
            gone = self._blocks.pop(block, None)
            if gone is not None:
                self._evicted.extend(gone.keys)

    def cleared(self) -> None:
        for block in list(self._blocks):
            self.removed([block])

    def take(self) -> tuple[list[bytes], list[bytes]]:
        stored, evicted = self._stored, self._evicted
        self._stored, self._evicted = [], []
        return stored, evicted

    def held(self) -> list[bytes]:
        return [key for block in self._blocks.values() for key in block.keys]
