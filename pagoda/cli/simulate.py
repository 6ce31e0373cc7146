"""`pagoda simulate`: replay a crowd through the real scheduler with the fake model."""

from __future__ import annotations

import argparse
import json
import sys

from pagoda.core.engine_config import EngineConfig
from pagoda.core.machine import configure_threads
from pagoda.simulator.crowd import crowd_to_json, load_crowd, mixed_crowd
from pagoda.simulator.simulate import SimulationConfig, simulate


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="the deterministic crowd simulator")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--hangup-fraction", type=float, default=0.25)
    p.add_argument("--crowd", help="replay a crowd saved as JSON instead of generating one")
    p.add_argument("--save-crowd", help="write the crowd that was run to this JSON file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    configure_threads(1)  # the fake model's tensors are tiny: one thread pays no pool wake-ups on every op
    if not 0 <= args.hangup_fraction <= 1:
        raise SystemExit("--hangup-fraction must be in [0, 1]")
    plans = load_crowd(args.crowd) if args.crowd else mixed_crowd(args.seed, args.clients, args.hangup_fraction)
    if args.save_crowd:
        with open(args.save_crowd, "w") as f:
            f.write(crowd_to_json(plans))
    engine = EngineConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens,
        max_model_len=args.max_model_len,
    )
    report = simulate(plans, SimulationConfig(engine=engine, model_seed=args.seed))
    summary = report.summary()
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:>22}: {value}")
        if not report.ok:
            print("FAILED: " + ", ".join(_failures(report)), file=sys.stderr)
    return 0 if report.ok else 1


def _failures(report) -> list[str]:
    failures = []
    if report.audit != "ok":
        failures.append(f"audit: {report.audit}")
    if report.pool["free"] != report.pool["total"]:
        failures.append(f"pool not returned: {report.pool}")
    if not report.matches_solo:
        failures.append("a completed client's output differs from its solo run")
    return failures
