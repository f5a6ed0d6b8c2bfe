"""Chained block keys: prefix sharing, full blocks only, namespace isolation."""

from __future__ import annotations

import hashlib
import struct

import pytest

from halfmoon.core.keys import ROOT_KEY, BlockHasher, Namespace


class TestChain:
    def test_key_is_sha256_of_parent_namespace_and_le_int32_tokens(self) -> None:
        h = BlockHasher(2, Namespace("model-x"))
        expected = hashlib.sha256(ROOT_KEY + Namespace("model-x").digest() + struct.pack("<2i", 5, 70000)).digest()
        assert h.keys([5, 70000]) == [expected]

    def test_equal_prefixes_give_equal_keys_then_diverge(self) -> None:
        h = BlockHasher(4, "m")
        a = h.keys(list(range(16)))
        b = h.keys([*range(8), 99, *range(9, 16)])
        assert a[:2] == b[:2]
        assert a[2] != b[2] and a[3] != b[3]  # the chain carries the difference onward
        assert all(len(k) == 32 for k in a)

    def test_only_full_blocks_get_keys(self) -> None:
        h = BlockHasher(4, "m")
        assert len(h.keys(list(range(11)))) == 2
        assert h.keys([1, 2, 3]) == []
        assert h.keys(list(range(11)))[:2] == h.keys(list(range(8)))

    def test_same_block_at_another_position_differs(self) -> None:
        h = BlockHasher(2, "m")
        assert h.keys([1, 2, 1, 2])[0] != h.keys([1, 2, 1, 2])[1]


class TestNamespace:
    def test_salts_and_models_never_share(self) -> None:
        tokens = list(range(8))
        plain = BlockHasher(4, Namespace("m")).keys(tokens)
        tenant_a = BlockHasher(4, Namespace("m", "tenant-a")).keys(tokens)
        tenant_a2 = BlockHasher(4, Namespace("m", "tenant-a")).keys(tokens)
        tenant_b = BlockHasher(4, Namespace("m", "tenant-b")).keys(tokens)
        other_model = BlockHasher(4, Namespace("m2")).keys(tokens)
        assert tenant_a == tenant_a2
        assert not {*plain} & {*tenant_a} and not {*tenant_a} & {*tenant_b} and not {*plain} & {*other_model}

    def test_field_boundaries_and_empty_salt_are_distinct(self) -> None:
        assert Namespace("ab", "c").digest() != Namespace("a", "bc").digest()
        assert Namespace("m", "").digest() != Namespace("m", None).digest()


class TestBadInput:
    def test_rejects_bad_arguments(self) -> None:
        with pytest.raises(ValueError):
            BlockHasher(0, "m")
        with pytest.raises(ValueError):
            BlockHasher(4, "")
        h = BlockHasher(2, "m")
        with pytest.raises(ValueError):
            h.keys([1, 2**31])
        with pytest.raises(ValueError):
            h.key(b"short", [1, 2])
        with pytest.raises(ValueError):
            h.key(ROOT_KEY, [1])
