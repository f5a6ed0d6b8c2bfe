"""The device-free half of one-sided transfers: registrations, work-request batching, completions.

An RDMA (or Mooncake) transfer is a list of ``Copy`` (local address, remote address, length).
``plan_posts`` turns it into posts of chained work requests the way an RC queue pair wants
them: copies adjacent on the remote side share one work request (scatter-gather on the local
side, at most ``max_sge`` elements), no message exceeds ``max_message`` bytes, at most
``max_wr`` requests go in one post and only the last request of a post asks for a completion
(an RC queue pair completes in order, so one completion retires the whole post).
``Registrations`` keeps what is registered, so a buffer is registered once and later copies
only look their keys up. ``Completions`` is the bookkeeping between posting and polling.
Nothing here touches a device: the verbs layer (``rdma.py``) only executes these plans.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, NamedTuple, TypeVar

PAGE = 4096
H = TypeVar("H")


class Copy(NamedTuple):
    """One contiguous one-sided transfer between a local and a remote address."""

    local: int
    remote: int
    length: int


class Sge(NamedTuple):
    addr: int
    length: int


class WorkRequest(NamedTuple):
    """One RDMA READ/WRITE: a contiguous remote range scattered over local elements."""

    remote: int
    sges: tuple[Sge, ...]

    @property
    def length(self) -> int:
        return sum(s.length for s in self.sges)


class Post(NamedTuple):
    """Work requests chained into one post; only the last is signalled."""

    wrs: tuple[WorkRequest, ...]

    @property
    def nbytes(self) -> int:
        return sum(wr.length for wr in self.wrs)


class PostLimits(NamedTuple):
    """Device limits the plan respects (``ibv_device_attr`` / the queue pair's caps)."""

    max_sge: int = 16
    max_wr: int = 64
    max_message: int = 1 << 30
    queue_depth: int = 256  # send-queue entries in flight at once

    def check(self) -> None:
        if min(self.max_sge, self.max_wr, self.max_message, self.queue_depth) < 1 or self.max_wr > self.queue_depth:
            raise ValueError(f"post limits must be positive with max_wr <= queue_depth, got {self}")


DEFAULT_LIMITS = PostLimits()


def _split(copies: Iterable[Copy], max_message: int) -> Iterable[Copy]:
    for c in copies:
        if c.length <= 0:
            raise ValueError(f"copy length must be positive, got {c}")
        for start in range(0, c.length, max_message):
            yield Copy(c.local + start, c.remote + start, min(max_message, c.length - start))


def plan_work_requests(copies: Iterable[Copy], limits: PostLimits = DEFAULT_LIMITS) -> list[WorkRequest]:
    """Coalesce copies in order into work requests (order matters to callers that slice views)."""
    limits.check()
    wrs: list[WorkRequest] = []
    remote_end = -1
    for c in _split(copies, limits.max_message):
        last = wrs[-1] if wrs else None
        if last is not None and c.remote == remote_end and last.length + c.length <= limits.max_message:
            tail = last.sges[-1]
            if tail.addr + tail.length == c.local:  # contiguous on both sides: grow the element
                wrs[-1] = last._replace(sges=(*last.sges[:-1], Sge(tail.addr, tail.length + c.length)))
                remote_end += c.length
                continue
            if len(last.sges) < limits.max_sge:
                wrs[-1] = last._replace(sges=(*last.sges, Sge(c.local, c.length)))
                remote_end += c.length
                continue
        wrs.append(WorkRequest(c.remote, (Sge(c.local, c.length),)))
        remote_end = c.remote + c.length
    return wrs


def plan_posts(copies: Iterable[Copy], limits: PostLimits = DEFAULT_LIMITS) -> list[Post]:
    wrs = plan_work_requests(copies, limits)
    return [Post(tuple(wrs[i : i + limits.max_wr])) for i in range(0, len(wrs), limits.max_wr)]


class Region(NamedTuple):
    addr: int
    length: int

    @property
    def end(self) -> int:
        return self.addr + self.length

    def covers(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.end


def page_span(addr: int, length: int, page: int = PAGE) -> Region:
    start = addr - addr % page
    end = -(-(addr + length) // page) * page
    return Region(start, end - start)


class Registrations(Generic[H]):
    """Registered local memory and its handles (an ``MR``, or Mooncake's registration).

    Contract: ``missing`` says which page-aligned regions must still be registered so that
    each span lies inside one registration (overlapping and adjacent spans merged; spans a
    registration already covers skipped); after ``add``, ``handle`` finds a registration
    covering a span. Registrations may overlap (verbs allow registering memory twice): a span
    that straddles an old registration's end gets a new one of its own. Processes register
    a handful of large buffers (the DRAM segment, the KV cache), so lookups scan a short list.
    """

    def __init__(self) -> None:
        self._regions: list[tuple[Region, H]] = []

    def _covering(self, addr: int, length: int) -> tuple[Region, H] | None:
        return next((entry for entry in self._regions if entry[0].covers(addr, length)), None)

    def handle(self, addr: int, length: int) -> H:
        found = self._covering(addr, length)
        if found is None:
            raise KeyError(f"[{addr:#x}, +{length}) is not inside one registered region")
        return found[1]

    def missing(self, spans: Iterable[tuple[int, int]]) -> list[Region]:
        pages = sorted(page_span(a, n) for a, n in spans if n > 0 and self._covering(a, n) is None)
        merged: list[Region] = []
        for r in pages:
            if merged and r.addr <= merged[-1].end:
                last = merged[-1]
                merged[-1] = Region(last.addr, max(last.end, r.end) - last.addr)
            else:
                merged.append(r)
        return merged

    def add(self, region: Region, handle: H) -> None:
        self._regions.append((region, handle))

    def remove(self, region: Region) -> H:
        for i, (reg, handle) in enumerate(self._regions):
            if reg == region:
                del self._regions[i]
                return handle
        raise KeyError(f"{region} is not registered")

    def handles(self) -> list[H]:
        return [h for _, h in self._regions]

    def __len__(self) -> int:
        return len(self._regions)


class CompletionError(Exception):
    """A work completion reported an error; the queue pair is unusable after it."""


class Completions:
    """Posts in flight on one queue pair, keyed by the ``wr_id`` of their signalled request.

    Contract: ``reserve(post)`` returns the ids to give each request (the last one is the
    signalled one) if the send queue has room for the whole post, else ``None`` (poll first);
    ``complete(wr_id, ok, status)`` retires the post whose signalled id it is, frees its queue
    entries and records the first failure (later ones are the flushes it caused); ``done`` is
    true once nothing is in flight. An error fails the whole transfer: on RC the queue pair
    moves to the error state and flushes every later request, so partial results are never
    trusted.
    """

    def __init__(self, queue_depth: int) -> None:
        if queue_depth < 1:
            raise ValueError("queue_depth must be >= 1")
        self.queue_depth = queue_depth
        self._next_id = 1
        self._inflight: dict[int, Post] = {}
        self._entries = 0
        self.bytes_done = 0
        self.errors: list[str] = []

    def reserve(self, post: Post) -> list[int] | None:
        n = len(post.wrs)
        if n > self.queue_depth:
            raise ValueError(f"a post of {n} requests never fits a queue of {self.queue_depth}")
        if self._entries + n > self.queue_depth:
            return None
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        self._inflight[ids[-1]] = post
        self._entries += n
        return ids

    def complete(self, wr_id: int, ok: bool, status: str = "") -> None:
        post = self._inflight.pop(wr_id, None)
        if post is not None:
            self._entries -= len(post.wrs)
            if ok:
                self.bytes_done += post.nbytes
        # unsignalled requests complete only with an error; the first error is the cause, later ones are flushes
        if not ok and not self.errors:
            self.errors.append(f"wr {wr_id}: {status}")

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    @property
    def done(self) -> bool:
        return not self._inflight

    def raise_if_failed(self) -> None:
        if self.errors:
            raise CompletionError("; ".join(self.errors))

