"""Real NATS peers standing in for prefill/decode: they take PrefillRequests and stream a script.

They speak the real protocol (heartbeats, submit/ack, TokenEvents numbered by index,
InstanceDown on shutdown), so the gateway under test cannot tell them from the real engine;
only the tokens are scripted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

from halfmoon.protocol import codecs
from halfmoon.protocol.base import Ack, ErrorCode, ErrorReply, Message
from halfmoon.protocol.registry import Load, Role
from halfmoon.protocol.stream import ErrorEvent, TokenEvent, Usage
from halfmoon.protocol.subjects import Subjects
from halfmoon.protocol.work import CancelRequest, PrefillRequest
from halfmoon.runtime import Service, ServiceConfig


@dataclass
class Script:
    """What the fake engine does with every request."""

    output: tuple[int, ...] = ()  # tokens to emit (cut at max_tokens)
    token_delay_s: float = 0.0
    stall_after: int | None = None  # emit this many tokens, then go quiet forever
    fail_after: int | None = None  # emit this many tokens, then an ErrorEvent
    cached_tokens: int = 0
    split_first: bool = True  # first token alone at index 0, like prefill then decode
    refuse: bool = False  # answer every submit "unavailable", like a draining instance
    faulty_attempts: int = 1 << 30  # stall_after/fail_after hit attempts below this one only


class ScriptedPrefill(Service[ServiceConfig]):
    role = Role.PREFILL

    def __init__(self, config: ServiceConfig, script: Script) -> None:
        super().__init__(config)
        self.script = script
        self.received: list[PrefillRequest] = []
        self.cancelled: list[str] = []
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def address(self) -> str:
        return self.subjects.prefill_submit_to(self.instance_id)

    def load(self) -> Load:
        return Load(running=len(self._tasks))

    async def start(self) -> None:
        await self.serve_addressed(self.address, codecs.PREFILL_REQUEST, self._on_submit, span_name="prefill.submit")
        await self.listen(self.subjects.cancel, codecs.CANCEL, self._on_cancel)

    async def _on_submit(self, request: PrefillRequest, subject: str) -> Message:
        self.received.append(request)
        if self.script.refuse:
            return ErrorReply(code=ErrorCode.UNAVAILABLE, message="draining", retryable=True)
        task = asyncio.create_task(self._run(request, self.subjects.stream(Subjects.submitter(subject),
                                                                           request.request_id)))
        self._tasks[request.request_id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(request.request_id, None))
        return Ack(request_id=request.request_id, instance_id=self.instance_id)

    async def _on_cancel(self, cancel: CancelRequest, _headers: Mapping[str, str]) -> None:
        self.cancelled.append(cancel.request_id)
        if (task := self._tasks.get(cancel.request_id)) is not None:
            task.cancel()

    async def _run(self, req: PrefillRequest, stream: str) -> None:
        s = self.script
        out = s.output[: req.sampling.max_tokens]
        finish = "length" if len(s.output) >= req.sampling.max_tokens else "stop"
        chunks = [out[:1], *[out[i : i + 1] for i in range(1, len(out))]] if s.split_first else [out]
        resumed = len(req.output_token_ids)  # a migrated request continues after what was delivered
        for n, chunk in enumerate(chunks):
            if sum(len(c) for c in chunks[:n]) < resumed:
                continue
            faulty = req.attempt < s.faulty_attempts
            if faulty and s.stall_after is not None and n >= s.stall_after:
                return
            if faulty and s.fail_after is not None and n >= s.fail_after:
                await self.publish(
                    stream,
                    ErrorEvent(
                        request_id=req.request_id,
                        code=ErrorCode.INTERNAL,
                        message="engine failed",
                        instance_id=self.instance_id,
                        attempt=req.attempt,
                    ),
                )
                return
            if s.token_delay_s:
                await asyncio.sleep(s.token_delay_s)
            last = n == len(chunks) - 1
            usage = (
                Usage(
                    prompt_tokens=len(req.prompt_token_ids),
                    completion_tokens=len(out),
                    cached_tokens=min(s.cached_tokens, len(req.prompt_token_ids)),
                )
                if last
                else None
            )
            await self.publish(
                stream,
                TokenEvent(
                    request_id=req.request_id,
                    index=sum(len(c) for c in chunks[:n]),
                    token_ids=tuple(chunk),
                    instance_id=self.instance_id,
                    attempt=req.attempt,
                    logprobs=tuple(-0.5 for _ in chunk) if req.sampling.logprobs else None,
                    finish_reason=finish if last else None,
                    usage=usage,
                ),
            )

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)


class IdleDecode(Service[ServiceConfig]):
    """A decode instance that registers; requests "held" by it die with it."""

    role = Role.DECODE

    @property
    def address(self) -> str:
        return self.subjects.decode_submit(self.instance_id)

    async def start(self) -> None:
        return None
