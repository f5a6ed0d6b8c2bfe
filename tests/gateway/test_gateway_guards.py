"""The gateway's pre-compute guards as functions: JSON nesting depth and the NATS message bound."""

from __future__ import annotations

import pytest

from halfmoon.protocol.sampling import SamplingParams
from halfmoon.services.gateway.errors import ApiError
from halfmoon.services.gateway.guards import check_nesting, check_wire_size, nesting_depth, wire_size


class TestNestingDepth:
    @pytest.mark.parametrize(("body", "depth"), [
        (b'{"a": 1}', 1),
        (b'{"m": [{"c": [{"t": "x"}]}]}', 5),  # a chat body's shape
        (b'[]', 1),
        (b'"[[[[[["', 0),  # brackets inside a string do not count
        (b'{"s": "a\\"[[[[", "t": [1]}', 2),  # nor after an escaped quote
        (b'{"a": [[]], "b": [[[ ]]]}', 4),
    ])
    def test_counts_structure_only(self, body: bytes, depth: int) -> None:
        assert nesting_depth(body) == depth

    def test_deep_bodies_stop_at_the_limit(self) -> None:
        assert nesting_depth(b"[" * 65 + b"]" * 65, 64) == 65
        assert nesting_depth(b"[" * 64 + b"]" * 64, 64) == 64
        with pytest.raises(ApiError) as info:
            check_nesting(b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        assert info.value.status == 400 and info.value.code == "nesting_too_deep"

    def test_an_unterminated_string_of_escaped_quotes(self) -> None:
        # a naive string pattern rescans such a run from every quote (10^11 steps here: the test's timeout)
        assert nesting_depth(b'"' + b'\\"' * 500_000 + b"[[") == 0


class TestWireSize:
    def test_grows_with_prompt_and_stop_strings(self) -> None:
        small = wire_size([1, 2, 3], SamplingParams())
        assert wire_size([1, 2, 3], SamplingParams(stop=("x" * 1000,))) >= small + 1000
        assert wire_size(list(range(1000)), SamplingParams()) > small

    def test_over_max_payload_is_413(self) -> None:
        check_wire_size([1, 2, 3], SamplingParams(), 1 << 20)
        with pytest.raises(ApiError) as info:
            check_wire_size([1, 2, 3], SamplingParams(stop=("x" * (1 << 20),)), 1 << 20)
        assert info.value.status == 413 and info.value.code == "request_too_large"
