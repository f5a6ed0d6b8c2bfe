"""The served model as the gateway sees it: tokenizer, chat template, context length, detokenising."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from halfmoon.engine.context import context_limit
from halfmoon.services.gateway.errors import ApiError, invalid
from halfmoon.services.gateway.schemas import ChatMessage


@dataclass(frozen=True)
class ServedModel:
    """Tokenises prompts and checks them against the context length; no I/O after ``load``."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    context_len: int
    vocab_size: int  # ids the tokenizer and the model's embedding both know

    @classmethod
    def load(cls, model_dir: str, name: str = "", max_model_len: int = 0) -> ServedModel:
        directory = Path(model_dir)
        config = AutoConfig.from_pretrained(directory)
        # NOTE: the same rule and figures as the engine's check, so both agree token for token
        context = context_limit(config, max_model_len)
        if context < 2:
            raise ValueError(f"{model_dir}: a context of {context} tokens leaves no room to generate")
        tokenizer = AutoTokenizer.from_pretrained(directory)
        vocab = min(len(tokenizer), getattr(config, "vocab_size", None) or len(tokenizer))
        return cls(name or directory.name, tokenizer, context, vocab)

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise ApiError(
                400,
                f"model {self.name!r} has no chat template; use /v1/completions.",
                param="messages",
                code="no_chat_template",
            )
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # template errors (e.g. role order) are the caller's input problem
            raise invalid(f"messages do not fit the model's chat template: {exc}", param="messages") from exc
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_ids(self, ids: list[int], param: str = "prompt") -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise invalid(f"token id {bad} is outside the vocabulary [0, {self.vocab_size}).", param=param)

    def output_budget(self, prompt_len: int, requested: int | None, default: int | None, param: str) -> int:
        """max_tokens to use, or a context_length_exceeded error."""
        if prompt_len < 1:
            raise invalid("The prompt is empty.", param=param, code="empty_prompt")
        room = self.context_len - prompt_len
        if room < 1 or (requested is not None and requested > room):
            asked = f" and {requested} tokens to generate" if requested is not None else ""
            raise invalid(
                f"This model's maximum context length is {self.context_len} tokens. However, you requested "
                f"{prompt_len} prompt tokens{asked}. Please reduce the length of the prompt or max_tokens.",
                param=param,
                code="context_length_exceeded",
            )
        if requested is not None:
            return requested
        return room if default is None else min(default, room)

    def token_text(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id])
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text

