"""Storing a request's newly computed KV blocks in the pool while the engine generates it."""

from __future__ import annotations

import asyncio
import contextlib

from halfmoon.core.errors import EngineError
from halfmoon.engine.engine import RequestOutput
from halfmoon.service.worker import EngineWorker

STORE_EVERY_BLOCKS = 4  # store generated KV once this many new full blocks are computed


class GeneratedKV:
    """Stores one request's newly computed full blocks in the pool, one store at a time, in the background.

    ``tokens``: the request's tokens so far; ``stored``: its leading full blocks the pool has already.
    """

    def __init__(self, worker: EngineWorker, request_id: str, tenant_salt: str | None, tokens: list[int],
                 stored: int) -> None:
        self.worker, self.request_id, self.tenant_salt = worker, request_id, tenant_salt
        self.size = worker.config.block_size
        self.tokens = tokens
        self.stored = stored
        self._task: asyncio.Task[None] | None = None

    def progress(self, out: RequestOutput, every: int = STORE_EVERY_BLOCKS) -> None:
        """Note ``out``'s tokens; store once ``every`` new full blocks are computed (1: every one now)."""
        self.tokens.extend(out.new_token_ids)
        if out.finished:
            return  # the engine has freed its KV
        # The newest sampled token has no KV yet: everything before it is computed.
        computed_blocks = (len(self.tokens) - 1) // self.size
        if computed_blocks - self.stored >= every and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._store(self.stored, computed_blocks, list(self.tokens)))
            self.stored = computed_blocks

    async def _store(self, start: int, end: int, tokens: list[int]) -> None:
        worker, rid = self.worker, self.request_id
        assert worker.engine is not None
        try:
            payloads = await worker.engine.call(lambda e: e.export_kv(rid))
        except EngineError:
            return  # finished or preempted meanwhile: nothing to store now
        keys = worker.engine.kv_spec.hasher(self.tenant_salt).keys(tokens)
        end = min(end, len(keys), len(payloads))
        if end > start:
            await worker.pool.store(keys[start:end], payloads[start:end], first_position=start)

    async def close(self, wait: bool) -> None:
        """Let the store in flight finish (the request ended) or drop it (the request was cancelled)."""
        if self._task is None or self._task.done():
            return
        if not wait:
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
