"""The `halfmoon` command: one entry point for people running the system."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module exposes register(subparsers); heavy imports stay inside the commands.
_COMMANDS = ("halfmoon.cli.model", "halfmoon.cli.up", "halfmoon.cli.sim", "halfmoon.cli.plan", "halfmoon.cli.trace", "halfmoon.cli.bench",
             "halfmoon.cli.security")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halfmoon", description="KVCache-centric disaggregated LLM serving")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _COMMANDS:
        # NOTE: a listed command that fails to import is a broken install: raise, never hide the command
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
