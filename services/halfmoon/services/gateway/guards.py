"""Checks a request passes before any compute: how deep its JSON nests, and whether it fits in one
NATS message. Both are refused with a 4xx here, not with a 500 from a decoder or a publish."""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

from halfmoon.protocol.sampling import SamplingParams
from halfmoon.services.gateway.errors import ApiError, invalid

MAX_JSON_DEPTH = 64  # the deepest real request (a chat message's content parts) nests 5 levels

# A JSON string, or an unterminated one up to the end; possessive, so a scan never backtracks and
# every byte is looked at once.
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_PAIR = b"[]"

# What travels with the prompt ids on the largest hand-off (prefill -> decode): request and
# instance ids, subjects, trace headers, and one block location per prompt block.
_WIRE_OVERHEAD_BYTES = 16 << 10
_WIRE_BYTES_PER_TOKEN = 16  # a block location (~200 bytes) per block of >= 16 tokens
_ENCODER = msgspec.msgpack.Encoder()


def nesting_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep ``body``'s arrays and objects nest, counted up to ``limit + 1``; linear in its size.

    Brackets inside strings do not count. Each pass deletes the innermost pairs, so after ``limit``
    passes brackets remain only where nesting goes deeper (or the body is not JSON at all).
    """
    structure = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS).translate(bytes.maketrans(b"{}", b"[]"))
    passes = 0
    while passes < limit and _PAIR in structure:
        structure = structure.replace(_PAIR, b"")
        passes += 1
    depth = deepest = 0
    for byte in structure:  # what is left: empty for any body within the limit
        depth += 1 if byte == 0x5B else -1
        deepest = max(deepest, depth)
        if deepest > limit - passes:
            return limit + 1
    return passes + max(deepest, 0)


def check_nesting(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    if nesting_depth(body, limit) > limit:
        raise invalid(f"The request body nests arrays or objects more than {limit} levels deep.",
                      code="nesting_too_deep")


def wire_size(prompt_ids: Sequence[int], sampling: SamplingParams) -> int:
    """An upper bound on the largest NATS message this request makes on the serving path."""
    return (len(_ENCODER.encode(list(prompt_ids))) + len(_ENCODER.encode(sampling)) + _WIRE_OVERHEAD_BYTES
            + len(prompt_ids) * _WIRE_BYTES_PER_TOKEN)


def check_wire_size(prompt_ids: Sequence[int], sampling: SamplingParams, max_payload: int) -> None:
    """413 when the request could not be published on NATS (the server's ``max_payload``)."""
    size = wire_size(prompt_ids, sampling)
    if size > max_payload:
        raise ApiError(
            413,
            f"The request needs a {size}-byte message on the serving path, over the message bus's "
            f"{max_payload}-byte limit; send a shorter prompt or fewer/shorter stop strings.",
            code="request_too_large",
        )
