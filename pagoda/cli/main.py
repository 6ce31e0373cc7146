"""The `pagoda` command line: one module per command under `pagoda.cli`."""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Sequence

# Each module defines `register(subparsers)`, which adds its parser and sets `func`.
COMMANDS = ("serve", "generate", "simulate", "bench", "plugins")


def _passive_openmp_threads() -> None:
    # Read by the OpenMP runtime when torch loads, so it is set before any command imports torch.
    # Waiting OpenMP threads sleep instead of spinning: on a CPU shared with the HTTP thread or other
    # processes, a spinning pool keeps the core busy and every parallel region then waits for a
    # descheduled thread (measured on 2 busy cores: a decode step 227 ms spinning, 56 ms passive).
    # An explicit OMP_WAIT_POLICY in the environment wins. No bounded spin (GOMP_SPINCOUNT) is set:
    # bfloat16 decode steps at 1/16/64 rows, 2 cores, two rounds each, measured 37-59/61-97/172-301 ms
    # passive, 43/68/181-209 ms with GOMP_SPINCOUNT=1000 and 97-110/135/349-371 ms with 10000 on the
    # quietest box we had, and with one `yes` busy 68-72/108-116/278-344 ms passive against 75-133/
    # 67-120/334-720 ms (spin 1000) and 172-328/250-286/602-773 ms (spin 10000): nothing robustly better.
    # The step instead keeps its small work off the OpenMP pool (pagoda/kernels/cpu_threads.py).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="An LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"pagoda.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    _passive_openmp_threads()
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
