"""What the hand-off no longer waits for: each test holds one step until decode has done what that step
used to hold up, so the wrong order would leave the step waiting and fail the test (ordering proved by
events, never by timing). The cluster (real NATS, cache-manager, shared-memory transfer node, prefill and
decode with the tiny model, layer-wise and whole-block): tests/runtime/conftest.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from halfmoon.core.keys import handoff_key
from tests.runtime.conftest import PROMPT, Cluster, serve, until

HOLD_S = 20.0  # a held step gives up after this and goes on, so a wrong order fails instead of hanging


def hold(owner: Any, attr: str, until_set: asyncio.Event, events: list[str], name: str) -> None:
    """Hold every call of ``owner.attr`` until ``until_set`` is set (or HOLD_S passed), noting ``name``."""
    inner: Callable[..., Awaitable[Any]] = getattr(owner, attr)

    async def held(*args: Any, **kwargs: Any) -> Any:
        try:
            await asyncio.wait_for(until_set.wait(), HOLD_S)
        except TimeoutError:
            events.append(f"{name} gave up waiting")
        events.append(name)
        return await inner(*args, **kwargs)

    setattr(owner, attr, held)


def note(owner: Any, attr: str, events: list[str], name: str, done: asyncio.Event) -> None:
    """Note ``name`` and set ``done`` when a call of ``owner.attr`` returns."""
    inner: Callable[..., Awaitable[Any]] = getattr(owner, attr)

    async def noted(*args: Any, **kwargs: Any) -> Any:
        out = await inner(*args, **kwargs)
        if not done.is_set():
            events.append(name)
            done.set()
        return out

    setattr(owner, attr, noted)


async def held_until_decode_received(  # type: ignore[no-untyped-def]
        cluster: Cluster, nc, namespace: str, expected: list[int], rid: str, owner: Any, attr: str, name: str) -> None:
    """Serve one request with prefill's ``owner.attr`` held until decode's ``receive`` returned: the
    output is the engine's and decode received first (it did not need that step)."""
    events: list[str] = []
    received = asyncio.Event()
    note(cluster.decode.handoff, "receive", events, "decode received the KV", received)
    hold(owner, attr, received, events, name)
    assert await serve(nc, namespace, cluster, rid) == expected
    assert events == ["decode received the KV", name]


def full_keys(cluster: Cluster) -> list[bytes]:
    assert cluster.prefill.engine is not None
    return cluster.prefill.engine.kv_spec.hasher(None).keys(PROMPT)


class TestCommitFollowsTheHandOff:
    async def test_decode_holds_the_kv_before_prefill_commits_it(  # type: ignore[no-untyped-def]
            self, cluster: Cluster, nc, namespace: str, expected: list[int]) -> None:
        await held_until_decode_received(cluster, nc, namespace, expected, "r-commit",
                                         cluster.prefill.handoff, "commit", "prefill commits")
        keys = full_keys(cluster)
        assert len(keys) == 2
        # committed after all: the full blocks are the pool's, for the next request with this prefix
        await until(lambda: cluster.cm.index.match(keys) == len(keys), "the full blocks in the pool")


class TestOneOffBlockDroppedOffThePath:
    async def test_decode_generates_before_it_drops_the_one_off_block(  # type: ignore[no-untyped-def]
            self, cluster: Cluster, nc, namespace: str, expected: list[int]) -> None:
        events: list[str] = []
        streaming = asyncio.Event()
        note(cluster.decode, "publish_event", events, "decode streams a token", streaming)
        hold(cluster.decode.pool, "remove", streaming, events, "decode drops the one-off block")
        tokens = await serve(nc, namespace, cluster, "r-drop")
        assert tokens == expected
        assert events == ["decode streams a token", "decode drops the one-off block"]
        one_off = handoff_key("r-drop", len(PROMPT) // cluster.prefill.config.block_size)
        store = cluster.node.store
        assert store is not None
        # dropped all the same: not in the pool's index (not even pending) nor on the node
        await until(lambda: cluster.cm.index.stats().pending_puts == 0, "no pending put left in the pool")
        assert cluster.cm.index.match([one_off]) == 0
        assert store.dram.find(one_off) is None and not store.dram.is_reserved(one_off)


class TestCacheEventsFollowTheHandOff:
    async def test_decode_has_the_request_before_prefill_publishes_cache_events(  # type: ignore[no-untyped-def]
            self, cluster: Cluster, nc, namespace: str, expected: list[int]) -> None:
        await held_until_decode_received(cluster, nc, namespace, expected, "r-events",
                                         cluster.prefill.prefix, "publish_cache_events", "prefill publishes its cache events")
