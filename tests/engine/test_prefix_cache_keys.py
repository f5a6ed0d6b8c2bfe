"""vLLM's prefix cache events as Halfmoon's block keys (engine/prefix_cache_keys.py): the keys a conductor
indexes are exactly those a request of the same tenant asks for, and nothing is claimed that was not seen."""

from __future__ import annotations

import random

from halfmoon.core.keys import BlockHasher, Namespace
from halfmoon.engine.prefix_cache_keys import PrefixCacheKeys

POOL = 16
VLLM = 64  # four pool blocks a vLLM block


def hasher_of(tenant: str | None) -> BlockHasher:
    return BlockHasher(POOL, Namespace("model", tenant))


def prompt(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(tokens)]


def vllm_blocks(tokens: list[int], first_key: bytes, tag: str) -> list[tuple[str, str | None, list[int], tuple]]:
    """(vLLM hash, parent hash, tokens, extra keys) of each full vLLM block, as vLLM would report them: the
    first salted with the request's first pool key."""
    out: list[tuple[str, str | None, list[int], tuple]] = []
    for n in range(len(tokens) // VLLM):
        out.append((f"{tag}{n}", f"{tag}{n - 1}" if n else None, tokens[n * VLLM:(n + 1) * VLLM],
                    (first_key.hex(),) if n == 0 else ()))
    return out


def test_a_requests_cached_blocks_become_the_keys_its_tenant_asks_for() -> None:
    tokens = prompt(1, 3 * VLLM + 5)
    keys = hasher_of("tenant-a").keys(tokens)
    cache = PrefixCacheKeys(hasher_of)
    cache.expect(keys[0], "tenant-a")
    blocks = vllm_blocks(tokens, keys[0], "a")
    # the first two stored in one event, the third in another, as vLLM batches them
    cache.stored([b[0] for b in blocks[:2]], None, [t for b in blocks[:2] for t in b[2]], VLLM,
                 [b[3] for b in blocks[:2]])
    cache.stored([blocks[2][0]], blocks[1][0], blocks[2][2], VLLM, [blocks[2][3]])
    stored, evicted = cache.take()
    assert stored == keys[:12] and evicted == []
    assert cache.take() == ([], [])
    assert sorted(cache.held()) == sorted(keys[:12])
    cache.removed([blocks[1][0]])
    assert cache.take() == ([], keys[4:8])
    cache.cleared()
    stored, evicted = cache.take()
    assert stored == [] and sorted(evicted) == sorted(keys[:4] + keys[8:12]) and cache.held() == []


def test_a_chain_it_cannot_name_is_left_out_never_guessed() -> None:
    tokens = prompt(2, 2 * VLLM)
    keys = hasher_of("tenant-b").keys(tokens)
    blocks = vllm_blocks(tokens, keys[0], "b")
    unknown = PrefixCacheKeys(hasher_of)  # never handed this first key out
    for block, parent, ids, extra in blocks:
        unknown.stored([block], parent, ids, VLLM, [extra])
    assert unknown.take() == ([], []) and unknown.held() == []
    # a first key expected under another tenant does not recompute from the tokens: left out too
    wrong = PrefixCacheKeys(hasher_of)
    wrong.expect(keys[0], "tenant-c")
    wrong.stored([blocks[0][0]], None, blocks[0][2], VLLM, [blocks[0][3]])
    assert wrong.take() == ([], [])
    # so is a block whose parent it never saw, and a removal of a block it never saw
    orphan = PrefixCacheKeys(hasher_of)
    orphan.stored([blocks[1][0]], blocks[0][0], blocks[1][2], VLLM, [()])
    orphan.removed(["never-stored"])
    assert orphan.take() == ([], [])


def test_tenants_are_told_apart_by_the_first_key_of_each_chain() -> None:
    tokens = prompt(3, VLLM)
    cache = PrefixCacheKeys(hasher_of)
    chains = {}
    for tenant in ("tenant-a", "tenant-b"):
        keys = hasher_of(tenant).keys(tokens)
        cache.expect(keys[0], tenant)
        (block,) = vllm_blocks(tokens, keys[0], tenant)
        cache.stored([block[0]], None, block[2], VLLM, [block[3]])
        chains[tenant] = keys
    stored, _ = cache.take()
    assert stored == chains["tenant-a"] + chains["tenant-b"]
    assert set(chains["tenant-a"]).isdisjoint(chains["tenant-b"])


def test_it_remembers_a_bounded_number_of_first_keys() -> None:
    cache = PrefixCacheKeys(hasher_of, remember=2)
    chains = []
    for seed in range(3):
        tokens = prompt(10 + seed, VLLM)
        keys = hasher_of(None).keys(tokens)
        cache.expect(keys[0], None)
        chains.append((tokens, keys))
    for n, (tokens, keys) in enumerate(chains):
        (block,) = vllm_blocks(tokens, keys[0], f"c{n}")
        cache.stored([block[0]], None, block[2], VLLM, [block[3]])
    stored, _ = cache.take()
    assert stored == chains[1][1] + chains[2][1]  # the oldest first key was forgotten
