"""Storing a request's newly computed KV blocks in the pool while the engine generates it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence as Seq

from halfmoon.core.errors import EngineError
from halfmoon.engine.interface import STORE_GENERATED_EVERY_BLOCKS, RequestOutput
from halfmoon.runtime.worker import EngineWorker


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

    def progress(self, out: RequestOutput) -> None:
        """Note ``out``'s tokens; store once ``STORE_GENERATED_EVERY_BLOCKS`` new full blocks are computed. Payloads
        the engine exported with the output (``prompt_kv``) are stored at once, even if it ended."""
        self.tokens.extend(out.new_token_ids)
        if out.prompt_kv:
            # NOTE: the first output is the only one with prompt_kv, so no store is in flight yet.
            end = self.stored + len(out.prompt_kv)
            self._task = asyncio.create_task(self._store(self.stored, end, list(self.tokens), out.prompt_kv))
            self.stored = end
            return
        if out.finished:
            return  # the engine has freed its KV
        # The newest sampled token has no KV yet: everything before it is computed.
        computed_blocks = (len(self.tokens) - 1) // self.size
        if computed_blocks - self.stored >= STORE_GENERATED_EVERY_BLOCKS and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._store(self.stored, computed_blocks, list(self.tokens)))
            self.stored = computed_blocks

    async def _store(self, start: int, end: int, tokens: list[int], payloads: Seq[bytearray] = ()) -> None:
        """Store blocks ``start`` to ``end``: ``payloads`` if given (from ``start`` on), else exported now."""
        worker, rid = self.worker, self.request_id
        assert worker.engine is not None
        if not payloads:
            try:
                payloads = await worker.engine.export_kv(rid, start, end)
            except EngineError:
                return  # finished or preempted meanwhile: nothing to store now
        keys = worker.engine.kv_spec.hasher(self.tenant_salt).keys(tokens)[start:end]
        count = min(len(keys), len(payloads))
        if count:
            await worker.pool.store(keys[:count], payloads[:count], first_position=start)

    async def close(self, wait: bool) -> None:
        """Let the store in flight finish (the request ended) or drop it (the request was cancelled)."""
        if self._task is None or self._task.done():
            return
        if not wait:
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
