"""A request resumed elsewhere from the pool's blocks computes the KV its first attempt had, bit for bit.

The first attempt: a prefill engine computes the prompt (in chunks of 64), a decode engine imports it and
generates beside another request. The resumed attempt: another prefill engine (chunks of 512, beside another
prompt) gets the prompt + the tokens delivered so far, and as its KV the full blocks the pool would hold
(the prompt's, stored by prefill; the generated ones, stored by decode every 4 blocks); it recomputes the
rest. Greedy output, logprobs and the KV of every block must equal the first attempt's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from halfmoon.engine import kernel_build
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.interface import STORE_GENERATED_EVERY_BLOCKS, RequestKV
from halfmoon.engine.weights import Projection
from halfmoon.protocol.sampling import SamplingParams
from tests.engine.conftest import make_engine, random_prompts

SIZE = 16
PARAMS = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True, logprobs=True)


def engine(model: Path, chunk: int) -> LLMEngine:
    return make_engine(model, block_size=SIZE, kv_cache_blocks=256, prefill_chunk_size=chunk,
                       max_num_batched_tokens=1024)


def prefill(e: LLMEngine, prompt: list[int], outputs: list[int], pool: list[bytearray]) -> tuple[int, float, list[bytearray]]:
    """The next token, its logprob and the request's KV payloads (the partial last block too)."""
    e.add_request("busy", random_prompts(e.vocab_size, [70], seed=9)[0], PARAMS, prefill_only=True)
    e.add_request("r", prompt, PARAMS, output_token_ids=outputs, prefill_only=True, kv=RequestKV(source=pool))
    last = None
    while e.has_unfinished():
        last = next((out for out in e.step() if out.request_id == "r"), last)
    assert last is not None
    kv = e.export_kv("r")
    e.release("r")
    return last.new_token_ids[0], last.new_logprobs[0], kv


def decode(e: LLMEngine, prompt: list[int], outputs: list[int], kv: list[bytearray],
           snapshot_at: int | None = None) -> tuple[list[int], list[float], list[bytearray]]:
    """Generate to the end beside another request; the full blocks computed once ``snapshot_at`` outputs are out."""
    e.add_request("other", random_prompts(e.vocab_size, [30], seed=8)[0], PARAMS)
    e.add_request("r", prompt, PARAMS, output_token_ids=outputs, kv=RequestKV(source=kv))
    tokens, logprobs, snapshot = list(outputs), [], []
    while e.has_unfinished():
        for out in e.step():
            if out.request_id != "r":
                continue
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
            if len(tokens) == snapshot_at:
                snapshot = e.export_kv("r", 0, (len(prompt) + len(tokens) - 1) // SIZE)
    return tokens, logprobs, snapshot


@pytest.mark.parametrize(("prompt_len", "resume_at"), [(12, 5), (40, 30), (40, 72), (150, 50)])
def test_a_resumed_request_has_the_first_attempts_kv(tiny_llama: Path, prompt_len: int, resume_at: int) -> None:
    prompt = random_prompts(1000, [prompt_len], seed=prompt_len)[0]
    first_token, first_logprob, prompt_kv = prefill(engine(tiny_llama, 64), prompt, [], [])
    tokens, logprobs, pool = decode(engine(tiny_llama, 512), prompt, [first_token], prompt_kv, snapshot_at=resume_at)
    logprobs = [first_logprob, *logprobs]
    # decode stores generated blocks STORE_GENERATED_EVERY_BLOCKS at a time after the prompt's: the newest are
    # not there
    stored = len(pool) - (len(pool) - prompt_len // SIZE) % STORE_GENERATED_EVERY_BLOCKS
    token, logprob, resumed_kv = prefill(engine(tiny_llama, 512), prompt, tokens[:resume_at], pool[:stored])
    assert stored * SIZE < prompt_len + resume_at - 1  # something is recomputed
    assert [bytes(b) for b in resumed_kv[stored:len(pool)]] == [bytes(b) for b in pool[stored:]]
    assert (token, logprob) == (tokens[resume_at], logprobs[resume_at])
    rest, rest_logprobs, _ = decode(engine(tiny_llama, 512), prompt, [*tokens[:resume_at], token], resumed_kv)
    assert rest == tokens
    assert [*logprobs[:resume_at], logprob, *rest_logprobs] == logprobs


# oneDNN's bfloat16 kernels on AMX tiles choose how to block a long reduction by the rows of the call: up to
# 32 rows a row rounds as alone, past that (SmolLM2's 1,536-input down projection) by the count
AMX_ROWS_AS_ALONE = 32
BFLOAT16_ROWS_ROUND_BY_COUNT = "amx_bf16" in kernel_build.cpu_flags()  # past AMX_ROWS_AS_ALONE rows


def exact_counts(dtype: torch.dtype, in_features: int) -> tuple[int, ...]:
    """The row counts whose calls give each row its one-row result, on this CPU."""
    if dtype == torch.bfloat16 and in_features > 256 and BFLOAT16_ROWS_ROUND_BY_COUNT:
        return (2, 7, AMX_ROWS_AS_ALONE)
    return (2, 7, 64, 300)


def test_projections_give_a_row_the_same_result_whatever_rows_share_the_call() -> None:
    """What exactness rests on besides attention: a prefill chunk's rows and a decode batch's rows multiply by
    the same weights in calls of other shapes (on AMX in bfloat16, in calls of up to 32 rows: RELIABILITY)."""
    torch.manual_seed(0)
    # (576, 1536): SmolLM2's MLP down projection, whose one-row calls oneDNN summed in another order on AVX-512
    for dtype in (torch.float32, torch.bfloat16):
        for out_features, in_features in ((384, 256), (576, 1536)):
            projection = Projection(torch.randn(out_features, in_features, dtype=dtype), None)
            rows = torch.randn(300, in_features, dtype=dtype)
            alone = torch.cat([projection(rows[i:i + 1]) for i in range(rows.shape[0])])
            for count in exact_counts(dtype, in_features):
                assert torch.equal(projection(rows[:count]), alone[:count]), (dtype, in_features, count)


def prompt_kv_in_chunks(model: Path, prompt: list[int], chunks: tuple[int, ...], sdpa: bool) -> dict[int, list[bytes]]:
    """The prompt's KV payloads computed in chunks of each size, on the prefill kernel or on SDPA."""
    kv = {}
    for chunk in chunks:
        e = engine(model, chunk)
        if sdpa:
            e.runner.kernels = e.runner.kernels._replace(prefill=None)
        elif e.runner.kernels.prefill is None:
            pytest.skip("no prefill kernel here (no C compiler): prompt chunks run on SDPA")
        kv[chunk] = [bytes(b) for b in prefill(e, prompt, [], [])[2]]
    return kv


def test_prompt_blocks_recomputed_in_other_chunks_are_the_same_on_the_kernel(tiny_llama: Path) -> None:
    """The prefill kernel starts its key tiles at fixed positions, so a query's attention does not depend on
    the chunk that computed it: a resumed request whose pool lost the prompt's blocks recomputes them bit for
    bit, in whatever chunks it starts from."""
    prompt = random_prompts(1000, [300], seed=3)[0]
    kv = prompt_kv_in_chunks(tiny_llama, prompt, (512, 100, 48), sdpa=False)
    assert kv[512] == kv[100] == kv[48]


def test_prompt_blocks_recomputed_in_other_chunks_may_differ_on_sdpa(tiny_llama: Path) -> None:
    """Without the kernel, the prompt's full blocks are computed many queries at a time by SDPA, whose
    rounding depends on where the chunks start and end. A resumed request whose pool lost them recomputes
    them in other chunks than the first attempt did (it starts at the blocks it found), and may continue
    differently."""
    prompt = random_prompts(1000, [300], seed=3)[0]
    kv = prompt_kv_in_chunks(tiny_llama, prompt, (512, 100), sdpa=True)
    full = len(prompt) // SIZE
    if kv[512][:full] == kv[100][:full]:
        pytest.skip("this machine's SDPA rounds the same whatever the chunks: no exception here")
    # and it reaches the tokens after them, which attend to them
    assert kv[512][full] != kv[100][full]
