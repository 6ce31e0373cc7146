"""The `pagoda` command line: one module per command under `pagoda.cli`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from pagoda.core.machine import prepare_process

# Each module defines `register(subparsers)`, which adds its parser and sets `func`.
COMMANDS = ("serve", "generate", "simulate", "bench", "plugins", "router")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="An LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"pagoda.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    prepare_process()  # before any command imports torch: the CPU set-up every entry point shares
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command_line = argv  # as given: `serve --data-parallel-size N` hands it on to its replicas
    return int(args.func(args) or 0)
