"""The transfer nodes a worker can move KV through, as their heartbeats announce them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import NamedTuple

from halfmoon.protocol.base import ErrorCode, ErrorReply, RemoteError
from halfmoon.protocol.registry import Heartbeat, InstanceDown, Role


class TransferNode(NamedTuple):
    instance_id: str
    address: str
    seen: float
    deadline: float


class TransferDirectory:
    """Live transfer nodes from heartbeats; picks the preferred one, else the first live by id."""

    def __init__(self, preferred: str = "") -> None:
        self.preferred = preferred
        self._nodes: dict[str, TransferNode] = {}
        self._changed = asyncio.Event()

    async def on_heartbeat(self, heartbeat: Heartbeat, _headers: Mapping[str, str]) -> None:
        if heartbeat.role is Role.TRANSFER and heartbeat.leaving is None:
            now = time.time()
            self._nodes[heartbeat.instance_id] = TransferNode(heartbeat.instance_id, heartbeat.address, now,
                                                              now + 3 * heartbeat.interval_s)
            self._changed.set()
        elif heartbeat.role is Role.TRANSFER:
            self._nodes.pop(heartbeat.instance_id, None)

    async def on_down(self, down: InstanceDown, _headers: Mapping[str, str]) -> None:
        self._nodes.pop(down.instance_id, None)

    def live(self) -> list[TransferNode]:
        now = time.time()
        return sorted((n for n in self._nodes.values() if n.deadline >= now), key=lambda n: n.instance_id)

    def ordered(self) -> list[TransferNode]:
        """Live nodes, the preferred one first."""
        return sorted(self.live(), key=lambda n: n.instance_id != self.preferred)

    def forget(self, instance_id: str) -> None:
        """Stop using a node that failed; its next heartbeat brings it back."""
        self._nodes.pop(instance_id, None)

    async def choose(self, timeout: float) -> TransferNode:
        """The node to use, the preferred one if live; waits up to ``timeout`` for one to announce itself."""
        deadline = time.monotonic() + timeout
        while not (live := self.ordered()):
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RemoteError(ErrorReply(code=ErrorCode.UNAVAILABLE, retryable=True,
                                             message="no live transfer node to move KV through"))
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                continue
        return live[0]
