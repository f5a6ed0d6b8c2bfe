"""A batch's per-block hooks (``Transport``'s ``prepare`` and ``check``) beside the bytes' move.

The hooks (the KV block MAC: seal before a block leaves, verify once it landed) run on one
worker thread, in submission order, while the event loop's thread moves the neighbouring block:
a socket send or receive, or a shared-memory copy, none of which holds the GIL. So the MAC of
block i overlaps the move of block i+1 where a core is free, and reads bytes that were just
moved (in cache). One thread for the whole process: the hooks of concurrent batches never run
at once (a hook needs no lock), and AES-GCM holds the GIL anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from halfmoon.transfer.transport import BlockHook

_WORKER = ThreadPoolExecutor(1, thread_name_prefix="halfmoon-block-hooks")


class HookPipeline:
    """``submit(i, view)`` queues ``hook(i, view)``; ``drain()`` waits for every queued call and
    raises what a hook raised. Without a hook both do nothing."""

    def __init__(self, hook: BlockHook | None) -> None:
        self.hook = hook
        self._queued: list[Future[object]] = []

    def submit(self, index: int, view: memoryview) -> None:
        if self.hook is not None:
            self._queued.append(_WORKER.submit(self.hook, index, view))

    async def drain(self) -> None:
        queued, self._queued = self._queued, []
        if queued and not queued[-1].done():  # NOTE: one FIFO worker: the last done means all are
            await asyncio.wrap_future(queued[-1])
        for future in queued:
            future.result()


Move = Callable[[int, memoryview], Awaitable[object]]


async def move_prepared(prepare: BlockHook | None, views: Sequence[memoryview], move: Move) -> None:
    """``move(i, views[i])`` in order, each once ``prepare(i, views[i])`` is done, the next block's
    ``prepare`` running meanwhile; no hook runs on the caller's buffers once this returns."""
    ready = HookPipeline(prepare)
    try:
        for i, view in enumerate(views):
            if i == 0:
                ready.submit(0, view)
            await ready.drain()
            if i + 1 < len(views):
                ready.submit(i + 1, views[i + 1])
            await move(i, view)
    finally:
        await ready.drain()


async def move_checked(check: BlockHook | None, views: Sequence[memoryview | None], move: Move) -> None:
    """``move(i, views[i])`` in order for each view (``None``: skipped), then ``check(i, views[i])``
    while the next block moves; every check is done once this returns."""
    checks = HookPipeline(check)
    try:
        for i, view in enumerate(views):
            if view is not None:
                await move(i, view)
                checks.submit(i, view)
    finally:
        await checks.drain()


async def copy_into(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` (a ``Move`` for shared memory) without holding the GIL, so a hook runs
    meanwhile: numpy's copy releases it, a memoryview assignment does not. Same sizes."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
