"""`pagoda bench fleet`: the router's policies on a live fleet, measured in one run, beside the simulator's prediction.

For each policy (default: round_robin, then prefix) the run starts a fresh fleet, so that no policy inherits
another's cache: N `pagoda serve` replicas of the model (each `--threads-per-replica` torch threads, its own
process) and `pagoda router --policy P` in front of them, all child processes on loopback ports the kernel
picks. Each replica gets one short request of its own first (unrecorded: first-request costs stay out), then
the chat workload of `pagoda bench serve` runs through the router: every conversation at once, each turn sent
when the previous one has answered, resending the whole history behind a system prompt all conversations
share (pagoda/bench/serve/load.py). Measured per policy:

    hit rate   prefix-cache hit tokens / looked-up prompt tokens over the fleet, from the replicas' own /health
               (asked directly, summed), counted around the workload only
    TTFT, e2e  what the clients saw (p50, p90), from bench serve's own records

The prediction: the same conversations as a simulator crowd (each turn a follow-up of the one before, whose
prompt is the previous prompt, its answer and the new turn's tokens, rendered with the model's own chat
template, so the block structure is the live one) through `simulate_fleet` with each policy, on replicas of
the live replicas' pool and block size. The simulator's time is a cost model, not this CPU, so the run compares
hit-rate ratios (prefix / round_robin), not seconds.

    pagoda bench fleet --replicas 2 --conversations 8 --turns 6 --json fleet.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from pagoda.core.machine import cpu_facts, threads_environ
from pagoda.bench.serve.server import ROUTER_READY, pagoda_subprocess, serve_command
from pagoda.bench.serve.workloads import Conversation, conversations
from pagoda.core.engine_config import EngineConfig
from pagoda.core.routing import BALANCE_ABS_THRESHOLD, POLICIES
from pagoda.core.tokenizer import Tokenizer
from pagoda.simulator.crowd import ClientPlan
from pagoda.simulator.fleet import FleetConfig, simulate_fleet
from pagoda.simulator.simulate import SimulationConfig

SIM_VOCAB = 256  # the fake model's vocabulary: real token ids are folded into it (1..255; 0 is its EOS)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagoda bench fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default="round_robin,prefix", help="comma-separated router policies, run in turn")
    p.add_argument("--threads-per-replica", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=None, help="each replica's KV blocks (default: its own sizing)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=64, help="the shared system prompt's words (~tokens)")
    p.add_argument("--user-tokens", type=int, default=48, help="words (~tokens) in each user message")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--think-time", type=float, default=2.0, metavar="S",
                   help="mean seconds each user pauses before a turn (exponential; the simulator gets the same pauses)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--deadline", type=float, default=1200.0, help="seconds for each policy's workload")
    p.add_argument("--json", metavar="FILE", help="write the results")
    args = p.parse_args(argv)
    args.policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [name for name in args.policies if name not in POLICIES]
    if unknown or not args.policies:
        p.error(f"--policies: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(POLICIES)}")
    if args.replicas < 1 or args.threads_per_replica < 1:
        p.error("--replicas and --threads-per-replica must be at least 1")
    return args


@dataclass
class LiveFleet:
    router: str
    replicas: list[str]


@contextlib.contextmanager
def live_fleet(args: argparse.Namespace, policy: str) -> Iterator[LiveFleet]:
    """N replicas and a router over them, as child processes; all stopped on the way out."""
    env = {**os.environ, **threads_environ(args.threads_per_replica)}  # the count measured, whatever the user's
    with contextlib.ExitStack() as stack:
        replicas = [stack.enter_context(pagoda_subprocess(serve_command(args.model, num_blocks=args.num_blocks),
                                                          args.ready_timeout, env=env))
                    for _ in range(args.replicas)]
        cmd = [sys.executable, "-m", "pagoda", "router", "--port", "0", "--router-policy", policy,
               "--model", args.model, "--log-level", "warning", *(a for url in replicas for a in ("--replica", url))]
        router = stack.enter_context(pagoda_subprocess(cmd, args.ready_timeout, ready=ROUTER_READY))
        yield LiveFleet(router, replicas)


def replica_health(fleet: LiveFleet) -> list[dict[str, Any]]:
    """Each replica's own /health, asked now (the router's copy is its latest poll, up to an interval old)."""
    return [httpx.get(f"{url}/health", timeout=30).json() for url in fleet.replicas]


def run_live(args: argparse.Namespace, policy: str, convs: list[Conversation]) -> dict[str, Any]:
    """One policy on a fresh fleet: the hit rate and the clients' latencies."""
    from pagoda.bench.serve import sweep

    with live_fleet(args, policy) as fleet:
        for i, url in enumerate(fleet.replicas):  # each replica's first request, unrecorded and unshared
            httpx.post(f"{url}/v1/completions", json={"prompt": f"Warm-up {i}.", "max_tokens": 2}, timeout=120)
        before = replica_health(fleet)
        load_args = sweep.parse_args(["--url", fleet.router, "--workload", "chat", "--no-warmup", "--no-progress",
                                      "--conversations", str(args.conversations), "--turns", str(args.turns),
                                      "--system-tokens", str(args.system_tokens),
                                      "--user-tokens", str(args.user_tokens), "--output-len", str(args.output_len),
                                      "--seed", str(args.seed), "--deadline", str(args.deadline)])
        summaries, _ = asyncio.run(sweep.run(load_args, [sweep.Target("pagoda", fleet.router)], [], convs))
        after = replica_health(fleet)
    summary = summaries[0]

    def grown(key: str) -> list[int]:
        return [a[key] - b[key] for a, b in zip(after, before)]

    hits, queried = sum(grown("prefix_cache_hit_tokens_total")), sum(grown("prefix_cache_queried_tokens_total"))
    return {
        "policy": policy, "requests": summary["requests"], "ok": summary["ok"], "failed": summary["failed"],
        "prefix_hit_rate": hits / max(1, queried), "hit_tokens": hits, "queried_tokens": queried,
        "ttft_ms": summary["ttft_ms"], "e2e_ms": summary["e2e_ms"], "out_tok_per_s": summary["out_tok_per_s"],
        "preemptions": sum(grown("preemptions_total")), "requests_per_replica": grown("requests_total"),
        "kv_blocks_per_replica": before[0]["kv_blocks_total"], "kv_block_size": before[0]["kv_block_size"],
    }


def chat_crowd_from(convs: list[Conversation], tokenizer: Tokenizer, output_len: int) -> list[ClientPlan]:
    """The conversations as a simulator crowd: turn t follows turn t-1 and adds the tokens the chat template puts
    after the previous answer (its end, the next user message, the assistant's header). The answers are stand-ins
    of `output_len` one-token words, so each turn's length is the live one up to how the real answer tokenizes."""
    plans: list[ClientPlan] = []
    answer = " ".join(["pagoda"] * output_len)
    for c, conv in enumerate(convs):
        messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}]
        before = 0  # the tokens the previous turn's prompt and answer hold
        for t, user in enumerate(conv.user_turns):
            messages.append({"role": "user", "content": user})
            ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
            own = tuple(1 + i % (SIM_VOCAB - 1) for i in ids[before:])  # folded into the fake model's vocabulary
            plans.append(ClientPlan(f"c{c}t{t}", arrival=conv.think_s[t] if conv.think_s else 0.0, prompt=own,
                                    max_tokens=output_len, ignore_eos=True, after=f"c{c}t{t - 1}" if t else None))
            messages.append({"role": "assistant", "content": answer})
            before = len(ids) + output_len
    return plans


def predict(plans: list[ClientPlan], policy: str, replicas: int, num_blocks: int, block_size: int) -> dict[str, Any]:
    """The simulator's fleet on the same crowd: its hit rate and virtual-time latencies."""
    engine = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=8192)
    # the live router's defaults (pagoda router), not the simulator's (whose absolute threshold is a max_running)
    fleet = FleetConfig(replicas=replicas, router=policy, balance_abs_threshold=BALANCE_ABS_THRESHOLD)
    report = simulate_fleet(plans, fleet,
                            SimulationConfig(engine=engine, vocab_size=SIM_VOCAB), check_solo=False)
    if report.audit != "ok" or report.completed != len(plans):
        raise RuntimeError(f"the simulated fleet failed: audit {report.audit}, {report.completed}/{len(plans)} done")
    return {"policy": policy, "prefix_hit_rate": report.prefix_hit_rate, "ttft_s": report.ttft, "routes": report.routes,
            "preemptions": report.preemptions}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from pagoda.model.hub import resolve_model

    convs = conversations(args.conversations, args.turns, args.system_tokens, args.user_tokens, args.seed,
                          args.think_time)
    tokenizer = Tokenizer.from_dir(resolve_model(args.model, progress=False))
    try:
        live = [run_live(args, policy, convs) for policy in args.policies]
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        print(f"pagoda bench fleet: {exc}", file=sys.stderr)
        return 2
    plans = chat_crowd_from(convs, tokenizer, args.output_len)
    pool = live[0]["kv_blocks_per_replica"] or EngineConfig.num_blocks
    simulated = [predict(plans, policy, args.replicas, pool, live[0]["kv_block_size"]) for policy in args.policies]
    print(report(args, live, simulated))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": cpu_facts().describe(), "live": live, "simulated": simulated}, f,
                      indent=2)
    return 1 if any(run["failed"] for run in live) else 0


def report(args: argparse.Namespace, live: list[dict[str, Any]], simulated: list[dict[str, Any]]) -> str:
    """The table: per policy, live hit rate and latencies beside the simulator's hit rate; then the ratios."""
    lines = [f"{args.replicas} replicas x {args.threads_per_replica} thread(s), {args.conversations} conversations x "
             f"{args.turns} turns, system {args.system_tokens} + user {args.user_tokens} words, "
             f"{args.output_len} output tokens",
             "",
             "| policy | live hit rate | simulated hit rate | TTFT p50 ms | TTFT p90 ms | e2e p50 ms | requests/replica |",
             "|---|---|---|---|---|---|---|"]
    for run, sim in zip(live, simulated):
        lines.append(f"| {run['policy']} | {run['prefix_hit_rate']:.3f} | {sim['prefix_hit_rate']:.3f} | "
                     f"{run['ttft_ms']['p50']:.0f} | {run['ttft_ms']['p90']:.0f} | {run['e2e_ms']['p50']:.0f} | "
                     f"{run['requests_per_replica']} |")
    by = {run["policy"]: (run, sim) for run, sim in zip(live, simulated)}
    if "prefix" in by and "round_robin" in by:
        (p, ps), (r, rs) = by["prefix"], by["round_robin"]
        live_ratio = quotient(p["prefix_hit_rate"], r["prefix_hit_rate"])
        sim_ratio = quotient(ps["prefix_hit_rate"], rs["prefix_hit_rate"])
        lines += ["", f"hit-rate ratio prefix / round_robin: live {shown(live_ratio)}, simulated {shown(sim_ratio)} "
                      f"(simulated / live {shown(quotient(sim_ratio, live_ratio))}); "
                      f"TTFT p50 prefix / round_robin: {shown(quotient(p['ttft_ms']['p50'], r['ttft_ms']['p50']))}"]
    return "\n".join(lines)


def quotient(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is unknown or b is 0 (a policy that hit nothing)."""
    return a / b if a is not None and b else None


def shown(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"
