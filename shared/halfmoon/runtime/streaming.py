"""Engine outputs as stream events: the one place TokenEvents are built from RequestOutputs."""

from __future__ import annotations

from halfmoon.engine.interface import RequestOutput
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.stream import FinishReason, TokenEvent, Usage


def token_event(out: RequestOutput, params: SamplingParams, instance_id: str, cached_tokens: int,
                attempt: int) -> TokenEvent:
    """The event for one engine output; ``index`` is the position of its first token in the output.

    ``cached_tokens`` counts prompt tokens only (a migrated request also reuses output tokens' KV)."""
    finish: FinishReason | None = None
    if out.finished and out.finish_reason in ("stop", "length"):
        finish = "stop" if out.finish_reason == "stop" else "length"
    final = finish is not None
    return TokenEvent(
        request_id=out.request_id,
        index=out.num_output_tokens - len(out.new_token_ids),
        token_ids=tuple(out.new_token_ids),
        instance_id=instance_id,
        attempt=attempt,
        logprobs=tuple(out.new_logprobs) if params.logprobs else None,
        text=out.text_delta,
        finish_reason=finish,
        usage=Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                    cached_tokens=min(cached_tokens, out.num_prompt_tokens)) if final else None,
    )
