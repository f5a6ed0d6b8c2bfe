"""Failover: a read that fails on one path retries on the next path to the same node, then on
another replica; a write retries on the next path to the same node (its extents were placed
there by the cache-manager, so another node needs a new placement: the caller's ``put_start``).

The order of attempts and the memory of failed paths are pure (``attempt_order``,
``PathHealth``); ``PathFailover`` (one node, several paths: what ``TransferClient`` hands out)
and ``FailoverReader`` (several replicas) only execute them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple, TypeVar

from halfmoon.core.tiers import Tier
from halfmoon.storage.allocator import Extent
from halfmoon.storage.base import BlockNotFound, Buffer
from halfmoon.transfer.transport import ReadBatch, SegmentRange, TransferError, Transport, WriteBatch

T = TypeVar("T")


class BatchSource(NamedTuple):
    """A node holding the blocks, with their DRAM extents there when a lookup reported them."""

    address: str
    extents: Sequence[Extent] | None = None


class Path(NamedTuple):
    kind: str  # "shm", "rdma", "mooncake", "tcp"
    transport: Transport


class PathHealth:
    """Which (node, path kind) failed recently. Contract: after ``failed`` a path is skipped
    for ``cooldown_s`` (doubling with each consecutive failure, up to ``max_cooldown_s``),
    unless it is the last one left; ``succeeded`` forgets its failures. Time is passed in."""

    def __init__(self, cooldown_s: float = 1.0, max_cooldown_s: float = 60.0) -> None:
        if cooldown_s <= 0 or max_cooldown_s < cooldown_s:
            raise ValueError("need 0 < cooldown_s <= max_cooldown_s")
        self.cooldown_s, self.max_cooldown_s = cooldown_s, max_cooldown_s
        self._failures: dict[tuple[str, str], tuple[int, float]] = {}

    def failed(self, address: str, kind: str, now: float) -> None:
        count, _ = self._failures.get((address, kind), (0, 0.0))
        until = now + min(self.max_cooldown_s, self.cooldown_s * 2**count)
        self._failures[(address, kind)] = (count + 1, until)

    def succeeded(self, address: str, kind: str) -> None:
        self._failures.pop((address, kind), None)

    def healthy(self, address: str, kind: str, now: float) -> bool:
        entry = self._failures.get((address, kind))
        return entry is None or now >= entry[1]


def attempt_order(
    replicas: Sequence[BatchSource], kinds: Callable[[str], Sequence[str]], health: PathHealth, now: float
) -> list[tuple[int, str]]:
    """(replica index, path kind) to try, in order: each replica's healthy paths in preference
    order, replicas in the given order; paths in cool-down go last, so a request is never
    refused while any path might still work."""
    healthy: list[tuple[int, str]] = []
    cooling: list[tuple[int, str]] = []
    for i, rep in enumerate(replicas):
        for kind in kinds(rep.address):
            (healthy if health.healthy(rep.address, kind, now) else cooling).append((i, kind))
    return healthy + cooling


class PathFailover(Transport):
    """One node over several paths, fastest first. Contract: each call runs on the first path in
    ``attempt_order`` and, when it raises ``TransferError``, on the next (the failed path cools
    down in ``health``); only the last path's failure reaches the caller, naming every path
    tried. Ranged calls go to the ranged paths only (TCP moves whole blocks). A missing block is
    an answer, not a failure: it is returned (or raised) from the path that gave it."""

    def __init__(self, address: str, paths: Sequence[Path], health: PathHealth | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not paths:
            raise ValueError("a node needs at least one path")
        self.address, self.paths = address, list(paths)
        self.health, self._clock = health or PathHealth(), clock
        self.ranged = any(p.transport.ranged for p in self.paths)
        self.last_kind = ""  # the path the last successful call used

    async def _first(self, call: Callable[[Transport], Awaitable[T]], ranged: bool = False) -> T:
        paths = {p.kind: p.transport for p in self.paths if p.transport.ranged or not ranged}
        if not paths:
            raise TransferError(f"{self.address}: no path moves block ranges")
        errors = []
        for _, kind in attempt_order([BatchSource(self.address)], lambda _: list(paths), self.health, self._clock()):
            try:
                result = await call(paths[kind])
            except TransferError as exc:
                self.health.failed(self.address, kind, self._clock())
                errors.append(f"{kind}: {exc}")
                continue
            self.health.succeeded(self.address, kind)
            self.last_kind = kind
            return result
        raise TransferError(f"{self.address}: every path failed: " + "; ".join(errors))

    async def _read(self, batch: ReadBatch) -> list[memoryview | None]:
        return await self._first(lambda t: t.read(batch.keys, caps=batch.caps, missing_ok=True, extents=batch.extents,
                                                  into=batch.into, check=batch.check))

    async def _write(self, batch: WriteBatch) -> None:
        await self._first(lambda t: t.write(batch.keys, batch.payloads, caps=batch.caps, offsets=batch.offsets,
                                            tier=batch.tier, prepare=batch.prepare))

    async def read_ranges(self, ranges: Sequence[SegmentRange], *, into: memoryview | None = None) -> list[memoryview]:
        return await self._first(lambda t: t.read_ranges(ranges, into=into), ranged=True)

    async def write_ranges(self, ranges: Sequence[SegmentRange], payloads: Sequence[Buffer]) -> None:
        await self._first(lambda t: t.write_ranges(ranges, payloads), ranged=True)

    async def commit(self, keys: Sequence[bytes], sizes: Sequence[int], offsets: Sequence[int] | None = None,
                     caps: Sequence[bytes] = ()) -> None:
        await self._first(lambda t: t.commit(keys, sizes, offsets, caps), ranged=True)

    async def delete(self, keys: Sequence[bytes], *, caps: Sequence[bytes] = ()) -> int:
        return await self._first(lambda t: t.delete(keys, caps=caps))

    async def close(self) -> None:
        for p in self.paths:
            await p.transport.close()


class FailoverReader:
    """Contract: ``read`` returns the blocks from the first (replica, path) that delivers all of
    them; a ``TransferError`` or ``BlockNotFound`` moves on to the next; when every attempt
    failed it raises ``TransferError`` listing each (or ``BlockNotFound`` if every replica that
    answered lacked blocks). ``paths(address)`` gives a node's transports, fastest first."""

    def __init__(
        self,
        paths: Callable[[str], Awaitable[Sequence[Path]]],
        health: PathHealth | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._paths = paths
        self.health = health or PathHealth()
        self._clock = clock
        self.attempts: list[tuple[str, str, str]] = []  # (address, kind, outcome) of the last call

    async def _kinds(self, replicas: Sequence[BatchSource]) -> dict[str, dict[str, Transport]]:
        opened: dict[str, dict[str, Transport]] = {}
        for rep in replicas:
            if rep.address in opened:
                continue
            try:
                opened[rep.address] = {p.kind: p.transport for p in await self._paths(rep.address)}
            except TransferError as exc:
                self.attempts.append((rep.address, "open", str(exc)))
                opened[rep.address] = {}
        return opened

    async def read(
        self,
        keys: Sequence[bytes],
        replicas: Sequence[BatchSource],
        *,
        caps: Callable[[str], Sequence[bytes]] = lambda address: (),
        into: memoryview | None = None,
    ) -> list[memoryview]:
        """``caps(address)`` gives the capabilities for ``keys`` on that node (they name it)."""
        if not replicas:
            raise ValueError("no replica to read from")
        self.attempts = []
        opened = await self._kinds(replicas)
        order = attempt_order(replicas, lambda a: list(opened[a]), self.health, self._clock())
        missing: BlockNotFound | None = None
        for i, kind in order:
            rep = replicas[i]
            try:
                views = await opened[rep.address][kind].read(keys, caps=caps(rep.address), extents=rep.extents,
                                                             into=into)
            except TransferError as exc:
                self.health.failed(rep.address, kind, self._clock())
                self.attempts.append((rep.address, kind, str(exc)))
                continue
            except BlockNotFound as exc:  # this replica lost them (evicted, node restarted)
                missing = exc
                self.attempts.append((rep.address, kind, f"missing {len(exc.keys)}"))
                continue
            self.health.succeeded(rep.address, kind)
            self.attempts.append((rep.address, kind, "ok"))
            return views
        if missing is not None and all(outcome.startswith("missing") for *_, outcome in self.attempts):
            raise missing
        tried = "; ".join(f"{a} {k}: {o}" for a, k, o in self.attempts)
        raise TransferError(f"every path to every replica failed: {tried}")

    async def write(
        self,
        address: str,
        keys: Sequence[bytes],
        payloads: Sequence[Buffer],
        *,
        caps: Sequence[bytes] = (),
        offsets: Sequence[int] | None = None,
        tier: Tier = Tier.DRAM,
    ) -> str:
        """Store on one node through its first path that works; returns the path kind used."""
        self.attempts = []
        opened = (await self._kinds([BatchSource(address)]))[address]
        order = attempt_order([BatchSource(address)], lambda a: list(opened), self.health, self._clock())
        for _, kind in order:
            try:
                await opened[kind].write(keys, payloads, caps=caps, offsets=offsets, tier=tier)
            except TransferError as exc:
                self.health.failed(address, kind, self._clock())
                self.attempts.append((address, kind, str(exc)))
                continue
            self.health.succeeded(address, kind)
            return kind
        raise TransferError(f"{address}: every path failed: " + "; ".join(f"{k}: {o}" for _, k, o in self.attempts))
