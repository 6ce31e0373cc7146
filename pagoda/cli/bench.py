"""`pagoda bench NAME`: benchmarks live beside the code they measure; this only dispatches."""

from __future__ import annotations

import argparse
import importlib

# name -> module with `main(argv) -> int`
BENCHMARKS = {
    "scheduler": "pagoda.bench.scheduler",
    "kernels": "pagoda.bench.kernels",
    "offline": "pagoda.bench.offline",
    "disconnect": "pagoda.bench.disconnect",
    "crowd": "pagoda.bench.crowd",
    "serve": "pagoda.bench.serve.sweep",
    "grammar": "pagoda.bench.grammar",
    "soak": "pagoda.bench.soak",
    "step-ab": "pagoda.bench.step_ab",
    "weight-formats": "pagoda.bench.weight_formats",
    "speculative": "pagoda.bench.speculative",
    "roofline": "pagoda.bench.roofline",
    "step-parts": "pagoda.bench.step_parts",
    "tensor-parallel": "pagoda.bench.tensor_parallel",
    "moe": "pagoda.bench.moe",
    "fleet": "pagoda.bench.fleet",
    "router-read": "pagoda.bench.router_read",
    "invariance": "pagoda.bench.invariance",
    "answers": "pagoda.bench.answers",
    "eval": "pagoda.bench.eval",
    "lora": "pagoda.bench.lora",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS))
    p.add_argument("name", choices=sorted(BENCHMARKS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="options passed to that benchmark (see --help after the name)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(BENCHMARKS[args.name]).main(args.args) or 0)
