"""OpenAI request bodies as msgspec structs (types checked on decode) plus range checks.

Unknown fields are ignored, as OpenAI does; known fields are typed strictly (no "5" for 5).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from halfmoon.protocol.sampling import MAX_TOP_K, SEED_RANGE, SamplingParams
from halfmoon.services.gateway.errors import invalid

MAX_STOP_TOKEN_IDS = 64  # ids outside the vocabulary are refused where the vocabulary is known (ServedModel)


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class TextPart(msgspec.Struct, frozen=True):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, frozen=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class _Common(msgspec.Struct, frozen=True, kw_only=True):
    """Fields completions and chat share, with the checks OpenAI applies to them."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # extensions (vLLM-compatible names)
    top_k: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    cache_salt: str | None = None  # tenants with different salts never share cached KV (vLLM's field)

    def check(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise invalid(f"max_tokens must be at least 1, got {self.max_tokens}.", param="max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise invalid(f"temperature must be between 0 and 2, got {self.temperature}.", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise invalid(f"top_p must be greater than 0 and at most 1, got {self.top_p}.", param="top_p")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise invalid(f"top_k must be 0 (off) or a positive integer up to {MAX_TOP_K}, got {self.top_k}.",
                          param="top_k")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise invalid(f"seed must be a 64-bit signed integer, got {self.seed}.", param="seed")
        if self.n != 1:
            raise invalid("Only n=1 is supported.", param="n")
        if self.presence_penalty or self.frequency_penalty:
            raise invalid(
                "presence_penalty and frequency_penalty are not supported; send 0.",
                param="presence_penalty" if self.presence_penalty else "frequency_penalty",
            )
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true.", param="stream_options")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise invalid(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}.",
                          param="stop_token_ids")
        stops = self.stop_strings()
        if len(stops) > 16 or any(not s for s in stops):
            raise invalid("stop must be a non-empty string or a list of at most 16 non-empty strings.", param="stop")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, max_tokens: int, logprobs: bool) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop_strings(),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: str | list[int | str | list[int]]
    logprobs: int | None = None
    echo: bool = False

    def check(self) -> None:
        super().check()
        if self.logprobs is not None and self.logprobs != 0:
            raise invalid("Only logprobs=0 (the sampled token's log-probability) is supported.", param="logprobs")
        if self.echo:
            raise invalid("echo is not supported.", param="echo")
        if isinstance(self.prompt, list):
            kinds = {type(item) for item in self.prompt}
            if len(kinds) > 1:
                raise invalid(
                    "prompt must be a string, a list of token ids, or a one-element list of either.", param="prompt"
                )
            if kinds and kinds != {int} and len(self.prompt) != 1:
                raise invalid("Batched prompts are not supported; send one prompt per request.", param="prompt")

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids."""
        if isinstance(self.prompt, str):
            return self.prompt
        first = self.prompt[0] if self.prompt else None
        if isinstance(first, str | list):
            return first
        return [token for token in self.prompt if isinstance(token, int)]  # all of them, as check() ensured

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


class ChatCompletionRequest(_Common, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise invalid("'messages' must contain at least one message.", param="messages", code="empty_array")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise invalid(
                f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}.",
                param="max_completion_tokens",
            )
        if self.top_logprobs:
            raise invalid(
                "top_logprobs > 0 is not supported; logprobs=true gives the sampled tokens' ones.", param="top_logprobs"
            )

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs
