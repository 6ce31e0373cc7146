"""`pagoda simulate`: replay a crowd through the real scheduler with the fake model, on one engine or a fleet."""

from __future__ import annotations

import argparse
import json
import sys

from pagoda.cli.renamed_option import add_renamed_option
from pagoda.core.engine_config import EngineConfig
from pagoda.core.machine import configure_threads
from pagoda.core.routing import BALANCE_REL_THRESHOLD, POLICIES
from pagoda.core.scheduling import BUILTIN_POLICIES
from pagoda.simulator.crowd import (
    ClientPlan, agent_crowd, chat_crowd, crowd_to_json, load_crowd, mixed_crowd, noisy_neighbour_crowd,
    shared_prefix_crowd, with_adapters,
)
from pagoda.simulator.fleet import FleetConfig, FleetReport, simulate_fleet
from pagoda.simulator.report import SimulationReport
from pagoda.simulator.simulate import SimulationConfig, simulate

SHAPES = ("mixed", "shared-prefix", "chat", "agent", "noisy-neighbour")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="the deterministic crowd simulator")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--hangup-fraction", type=float, default=0.25, help="mixed crowds: the share that hang up")
    p.add_argument("--crowd", help="replay a crowd saved as JSON instead of generating one (its prompts may hold a "
                                   "real model's token ids: the fake model's vocabulary widens to hold them)")
    p.add_argument("--crowd-shape", choices=SHAPES, default="mixed",
                   help="the generated crowd: mixed (the default), one shared system prompt, multi-turn chats "
                        "(3 turns each), agents (3 steps each, behind one of 2 tool preambles) or noisy-neighbour "
                        "(tenant A: 64 closed-loop streams of 8 turns; tenant B: one stream of 8 turns; "
                        "--clients is ignored)")
    scheduling = p.add_argument("--scheduling-policy", default=EngineConfig.scheduling_policy,
                                choices=tuple(BUILTIN_POLICIES),
                                help="the scheduling policy (default fcfs); a crowd's plans may carry tenant, priority "
                                     "and weight")
    add_renamed_option(p, "--policy", scheduling)
    p.add_argument("--max-loras", type=int, default=EngineConfig.max_loras, metavar="N",
                   help="the most distinct LoRA adapters running at once (default %(default)s); a crowd's plans may "
                        "name an adapter, which the simulation loads")
    p.add_argument("--adapters", type=int, default=0, metavar="N",
                   help="a generated crowd's conversations ask in turn for the base model and N LoRA adapters "
                        "(lora0, lora1, ...; default 0: the base alone)")
    p.add_argument("--think-time", type=float, default=0.0, metavar="S",
                   help="noisy-neighbour: virtual seconds a client takes between an answer and its next request "
                        "(default 0: at once)")
    p.add_argument("--arrival-rate", type=float,
                   help="new clients (first turns) per virtual second; default: the shape's own spacing")
    p.add_argument("--replicas", type=int, default=1, help="engines behind a simulated router (default 1: no router)")
    router = p.add_argument("--router-policy", choices=POLICIES, help="the fleet's routing policy (default prefix)")
    add_renamed_option(p, "--router", router)
    p.add_argument("--balance-abs-threshold", type=int,
                   help="prefix: imbalanced when max - min load exceeds this (default: --max-running) ...")
    p.add_argument("--balance-rel-threshold", type=float, default=BALANCE_REL_THRESHOLD,
                   help=f"... and max exceeds this times min (default {BALANCE_REL_THRESHOLD})")
    p.add_argument("--save-crowd", help="write the crowd that was run to this JSON file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    configure_threads(1)  # the fake model's tensors are tiny: one thread pays no pool wake-ups on every op
    if not 0 <= args.hangup_fraction <= 1:
        raise SystemExit("--hangup-fraction must be in [0, 1]")
    if args.replicas < 1:
        raise SystemExit("--replicas must be >= 1")
    if args.arrival_rate is not None and args.arrival_rate <= 0:
        raise SystemExit("--arrival-rate must be > 0")
    if args.think_time < 0:
        raise SystemExit("--think-time must be >= 0")
    if args.max_loras < 1:
        raise SystemExit("--max-loras must be >= 1")
    if args.adapters < 0:
        raise SystemExit("--adapters must be >= 0")
    if args.adapters and args.crowd:
        raise SystemExit("--adapters shapes a generated crowd; a --crowd file's plans name their own adapter")
    if args.crowd:
        try:
            plans = load_crowd(args.crowd)
        except (OSError, ValueError) as exc:  # a file that cannot be read, or a plan in it that is wrong
            print(f"pagoda simulate: --crowd {args.crowd}: {exc}", file=sys.stderr)
            return 2
    else:
        plans = make_crowd(args.crowd_shape, args.seed, args.clients, args.hangup_fraction, args.arrival_rate,
                           args.think_time)
        if args.adapters:
            plans = with_adapters(plans, tuple(f"lora{i}" for i in range(args.adapters)))
    if args.save_crowd:
        with open(args.save_crowd, "w") as f:
            f.write(crowd_to_json(plans))
    engine = EngineConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens,
        max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy,
        max_loras=args.max_loras,
    )
    config = SimulationConfig(engine=engine, model_seed=args.seed)
    if args.replicas == 1 and args.router_policy is None:
        report: SimulationReport = simulate(plans, config)  # one engine, no router: the report as it always was
    else:
        fleet = FleetConfig(replicas=args.replicas, router=args.router_policy or "prefix", seed=args.seed,
                            balance_abs_threshold=args.balance_abs_threshold,
                            balance_rel_threshold=args.balance_rel_threshold)
        report = simulate_fleet(plans, fleet, config)
    summary = report.summary()
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            if key != "replicas":
                print(f"{key:>22}: {value}")
        if isinstance(report, FleetReport):
            print(replica_table(report))
        if not report.ok:
            print("FAILED: " + ", ".join(_failures(report)), file=sys.stderr)
    return 0 if report.ok else 1


def make_crowd(shape: str, seed: int, clients: int, hangup_fraction: float, rate: float | None,
               think_time: float = 0.0) -> list[ClientPlan]:
    """`clients` plans of the shape; chats and agents are cut to `clients` plans (whole conversations first)."""
    if shape == "mixed":
        window = {} if rate is None else {"arrival_window": clients / rate}
        return mixed_crowd(seed, clients, hangup_fraction, **window)
    if shape == "shared-prefix":
        gap = {} if rate is None else {"arrival_gap": 1 / rate}
        return shared_prefix_crowd(seed, clients=clients, **gap)
    if shape == "noisy-neighbour":
        return noisy_neighbour_crowd(seed, pause=think_time)
    sessions = -(-clients // 3)
    window = {} if rate is None else {"arrival_window": sessions / rate}
    if shape == "chat":
        return chat_crowd(seed, chats=sessions, turns=3, **window)[:clients]
    return agent_crowd(seed, agents=sessions, steps=3, **window)[:clients]


def replica_table(report: FleetReport) -> str:
    """One row per replica: what it was sent, what it did, its cache hits and its audit."""
    head = ("replica", "routed", "completed", "hung_up", "peak_running", "preemptions", "hit_rate", "audit")
    rows = [head] + [
        (str(i), str(r.routed), str(r.completed), str(r.hung_up), str(r.peak_running), str(r.preemptions),
         f"{r.prefix_hit_rate:.3f}", r.audit)
        for i, r in enumerate(report.replicas)
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def _failures(report: SimulationReport) -> list[str]:
    failures = []
    if report.audit != "ok":
        failures.append(f"audit: {report.audit}")
    if report.pool["free"] != report.pool["total"]:
        failures.append(f"pool not returned: {report.pool}")
    if not report.matches_solo:
        failures.append("a completed client's output differs from its solo run")
    return failures
