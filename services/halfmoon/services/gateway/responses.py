"""OpenAI response and stream-chunk bodies for completions and chat completions."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from halfmoon.protocol.stream import Usage

Kind = Literal["completion", "chat"]


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass
class LogprobAccumulator:
    """Per-token logprobs in the shape of the endpoint (completions: parallel lists; chat: content list)."""

    kind: Kind
    tokens: list[str] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, tokens: list[str], values: tuple[float, ...]) -> dict[str, Any]:
        self.tokens.extend(tokens)
        self.values.extend(values)
        return self.body(tokens, list(values))

    def body(self, tokens: list[str] | None = None, values: list[float] | None = None) -> dict[str, Any]:
        tokens = self.tokens if tokens is None else tokens
        values = self.values if values is None else values
        if self.kind == "completion":
            return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None, "text_offset": None}
        return {
            "content": [
                {"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
                for t, v in zip(tokens, values, strict=True)
            ],
            "refusal": None,
        }


@dataclass(frozen=True)
class ResponseShape:
    """Builds the bodies of one response: ids, timestamps and model are fixed per request."""

    kind: Kind
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def _object(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, text: str | None, finish: str | None, logprobs: dict | None, first: bool, final: bool) -> dict:
        if self.kind == "completion":
            return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if final:
            message = {"role": "assistant", "content": text, "refusal": None}
            return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text or first:
            delta["content"] = text or ""
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def full(self, text: str, finish: str | None, usage: Usage, logprobs: dict | None) -> dict[str, Any]:
        body = self._envelope(self._object, [self._choice(text, finish, logprobs, first=False, final=True)])
        body["usage"] = usage_body(usage)
        return body

    def chunk(self, text: str, finish: str | None, logprobs: dict | None, first: bool = False) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return self._envelope(obj, [self._choice(text, finish, logprobs, first=first, final=False)])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = self._envelope(obj, [])
        body["usage"] = usage_body(usage)
        return body
