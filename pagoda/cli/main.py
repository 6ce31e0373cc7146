"""The `pagoda` command line: one module per command under `pagoda.cli`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from pagoda.core.machine import prepare_process

# Each module defines `register(subparsers)`, which adds its parser and sets `func`.
COMMANDS = ("serve", "generate", "simulate", "bench", "plugins", "router")
NO_TORCH = ("router",)  # commands that never load torch (nor the OpenMP set-up that comes with it)


def build_parser(commands: Sequence[str] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="An LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in commands:
        importlib.import_module(f"pagoda.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None  # named: only its own module is imported
    if command not in NO_TORCH:
        prepare_process()  # before any command imports torch: the CPU set-up every entry point shares
    args = build_parser([command] if command else COMMANDS).parse_args(argv)
    args.command_line = argv  # as given: `serve --data-parallel-size N` hands it on to its replicas
    return int(args.func(args) or 0)
