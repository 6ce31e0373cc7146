"""`pagoda bench serve`: the command, and its sweep of every level against every server in turn."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence
from typing import Any

import httpx

from pagoda.bench.serve import load, tenant_mix
from pagoda.bench.serve.baseline import baseline_lines, transformers_sequential
from pagoda.bench.serve.client import Target, peer_endpoints, scrape_split, served_model, split_means
from pagoda.bench.serve.offline import SERVER as OFFLINE, OfflineEngine, offline_engine
from pagoda.bench.serve.offline import closed_loop as offline_loop, paired_lines, paired_ratios
from pagoda.bench.serve.peer import peer_process
from pagoda.bench.serve.report import summarize, table, turn_table, write_json, write_plots
from pagoda.bench.serve.server import pagoda_subprocess, serve_command
from pagoda.bench.serve.workloads import WORKLOADS, Conversation, Prompt, conversations, prompts_for
from pagoda.model.hub import resolve_model


DESCRIPTION = "load an OpenAI-compatible server over HTTP and measure what its clients see"


def _numbers(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagoda bench serve", description=DESCRIPTION)
    g = p.add_argument_group("servers")
    g.add_argument("--url", help="a running server (default: start a pagoda here)")
    g.add_argument("--peer-url", help="a second server given the same load; the table adds pagoda / peer ratios")
    g.add_argument("--peer-command", help="start the peer here with this command line (it must listen at --peer-url);"
                   " ready once --peer-url/health answers 200")
    g.add_argument("--api-key", help="bearer key for --url (or the pagoda started here)")
    g.add_argument("--peer-api-key")
    g.add_argument("--model-name", help="the request's model field (default: the server's first /v1/models id)")
    g.add_argument("--peer-model-name")
    g.add_argument("--model", default="default", help="what the pagoda started here serves")
    g.add_argument("--dtype")
    g.add_argument("--quantization", choices=("none", "int8", "int4", "gguf", "w8a8", "auto"))
    g.add_argument("--num-blocks", type=int)
    g.add_argument("--max-running", type=int)
    g.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="another `pagoda serve` argument, repeatable (e.g. --server-arg=--max-batched-tokens=1024)")
    g.add_argument("--scheduling-policy", type=tenant_mix.parse_policies, metavar="NAME[,NAME...]",
                   help="the pagoda started here schedules by it; with --tenant-mix a list, each policy on a fresh"
                        " server (default there: fcfs,fair)")
    g.add_argument("--server-ready-timeout", type=float, default=600.0, help="seconds for it (and a started peer) to be ready")
    g.add_argument("--transformers", action="store_true",
                   help="also time transformers' generate on the same prompts, one at a time (after the HTTP load)")
    g.add_argument("--offline-baseline", action="store_true",
                   help="also run each level's closed-loop load on the same engine in this process (no HTTP),"
                        " interleaved with the served load; the table adds pagoda / offline rows")
    g.add_argument("--offline-rounds", type=int, default=4, metavar="R",
                   help="with --offline-baseline: each level alternates served and offline R times (a shared, noisy"
                        " machine then loads both sides alike)")
    g = p.add_argument_group("load")
    g.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    g.add_argument("--concurrency", type=_numbers, default=[1.0, 4.0, 16.0], help="closed-loop client counts")
    g.add_argument("--request-rate", type=_numbers, help="open-loop Poisson rates per second (instead of --concurrency)")
    g.add_argument("--num-requests", type=int, default=32,
                   help="requests per level (--tenant-mix: the quietest tenant's, alone and then in the mix)")
    g.add_argument("--num-requests-per-level", type=_numbers, metavar="N,N,...",
                   help="closed loop: requests for each --concurrency level in turn (instead of --num-requests)")
    g.add_argument("--input-len", type=int, default=128, help="synthetic prompt words (~tokens)")
    g.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    g.add_argument("--crowd", help="a simulator crowd file (the crowd workload)")
    g.add_argument("--tenant-mix", type=tenant_mix.parse_tenant_mix, metavar="NAME:STREAMS,...",
                   help="tenants, each with its own key and STREAMS closed-loop clients (e.g. A:64,B:1): the quietest"
                        " runs alone, then beside the others, per --scheduling-policy (tenant_mix.py)")
    g.add_argument("--conversations", type=int, default=4, help="chat: clients, each one conversation")
    g.add_argument("--turns", type=int, default=6, help="chat: turns per conversation")
    g.add_argument("--system-tokens", type=int, default=1000, help="chat: the shared system prompt's words (~tokens)")
    g.add_argument("--user-tokens", type=int, default=24, help="chat: words (~tokens) in each user message")
    g.add_argument("--think-time", type=float, default=0.0, metavar="S",
                   help="chat: mean seconds a user pauses before each turn; --tenant-mix: before each request"
                        " (exponential; 0: none, back to back)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-warmup", action="store_true", help="skip the one unrecorded request per server")
    g = p.add_argument_group("bounds and results")
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    g.add_argument("--deadline", type=float, default=1800.0, help="seconds for the whole run")
    g.add_argument("--slo-ttft-ms", type=float)
    g.add_argument("--slo-tpot-ms", type=float)
    g.add_argument("--json", metavar="FILE", help="write summaries and every per-request record")
    g.add_argument("--plot-dir", metavar="DIR", help="write PNG plots (needs matplotlib)")
    g.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.workload == "chat":
        args.endpoint = "chat"  # conversations are chat messages
    if args.num_requests_per_level is not None:
        if args.request_rate or args.workload == "chat" or len(args.num_requests_per_level) != len(args.concurrency):
            p.error("--num-requests-per-level needs one count per --concurrency level (closed loop only)")
        args.num_requests = int(max(args.num_requests_per_level))  # what a synthetic workload generates
    if args.peer_command and not args.peer_url:
        p.error("--peer-command needs --peer-url: where the peer it starts will listen")
    if args.transformers and args.workload == "chat":
        p.error("--transformers times completion prompts; the chat workload has none")
    if args.offline_baseline and (args.url or args.request_rate or args.workload == "chat"):
        p.error("--offline-baseline runs the closed-loop levels of the pagoda started here (no --url, --request-rate"
                " or chat workload)")
    if args.offline_rounds < 1:
        p.error("--offline-rounds must be at least 1")
    if (args.workload == "crowd") != bool(args.crowd):
        p.error("--crowd FILE.json goes with --workload crowd, and that workload needs it")
    if args.think_time < 0:
        p.error("--think-time must be >= 0")
    if args.tenant_mix and (args.url or args.peer_url or args.api_key or args.request_rate or args.offline_baseline
                            or args.transformers or args.num_requests_per_level or args.workload != "synthetic"):
        p.error("--tenant-mix starts its own pagoda with a key per tenant and sends synthetic prompts (no --url,"
                " --peer-url, --api-key, --request-rate, --offline-baseline, --transformers,"
                " --num-requests-per-level or other --workload)")
    if args.scheduling_policy and not args.tenant_mix and (args.url or len(args.scheduling_policy) > 1):
        p.error("--scheduling-policy is one policy for the pagoda started here (a list needs --tenant-mix)")
    if min(args.num_requests, args.turns, args.conversations, args.output_len) < 1:
        p.error("--num-requests, --turns, --conversations and --output-len must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tenant_mix:
        return tenant_mix.main(args)
    try:
        # Built before any server starts, so that a bad crowd file costs nothing.
        prompts = [] if args.workload == "chat" else prompts_for(
            args.workload, num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
            seed=args.seed, crowd=args.crowd)
        convs = conversations(args.conversations, args.turns, args.system_tokens, args.user_tokens, args.seed,
                              args.think_time)
        with contextlib.ExitStack() as stack:
            policy = ("--scheduling-policy", args.scheduling_policy[0]) if args.scheduling_policy else ()
            url = args.url or stack.enter_context(pagoda_subprocess(
                serve_command(args.model, dtype=args.dtype, quantization=args.quantization,
                              num_blocks=args.num_blocks, max_running=args.max_running,
                              extra=[*policy, *args.server_arg]), args.server_ready_timeout))
            if args.peer_command:
                stack.enter_context(peer_process(args.peer_command, args.peer_url, args.server_ready_timeout))
            targets = [Target("pagoda", url.rstrip("/"), api_key=args.api_key)]
            if args.peer_url:
                targets.append(Target("peer", args.peer_url.rstrip("/"), api_key=args.peer_api_key,
                                      endpoints=peer_endpoints()))
            offline = offline_engine(args.model, dtype=args.dtype, quantization=args.quantization,
                                     max_running=args.max_running, prompts=prompts,
                                     max_concurrency=int(max(args.concurrency))) if args.offline_baseline else None
            summaries, records = asyncio.run(run(args, targets, prompts, convs, offline))
        # after the servers have stopped: the baseline gets the machine to itself
        baseline = transformers_sequential(resolve_model(args.model), prompts) if args.transformers else None
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"pagoda bench serve: {exc}", file=sys.stderr)
        return 2
    print(table(summaries, with_peer=len(targets) > 1 or args.offline_baseline))
    if args.offline_baseline:
        print()
        print(paired_lines(summaries))
    if args.workload == "chat":
        print()
        print(turn_table(summaries))
    if baseline is not None:
        print()
        print(baseline_lines(baseline, summaries))
    if args.json:
        write_json(args.json, {k: v for k, v in vars(args).items() if k not in ("api_key", "peer_api_key")},
                   summaries, records, baseline)
    if args.plot_dir:
        written = write_plots(args.plot_dir, summaries, records)
        print("plots: " + (", ".join(map(str, written)) if written else "skipped (matplotlib is not installed)"))
    failed = [s for s in summaries if s["failed"] or s["deadline_hit"]]
    for s in failed:
        print(f"{s['server']} {s['kind']}={s['level']:g}: {s['failed']} failed"
              f"{' (the run deadline cut it short)' if s['deadline_hit'] else ''}: {s['errors']}", file=sys.stderr)
    return 1 if failed else 0


def _round_sizes(num_requests: int, clients: int, rounds: int) -> list[int]:
    """A level's requests split into up to `rounds` interleaved rounds of at least `clients` requests each."""
    rounds = max(1, min(rounds, num_requests // max(clients, 1)))
    return [num_requests // rounds + (i < num_requests % rounds) for i in range(rounds)]


def _levels(args: argparse.Namespace) -> tuple[str, list[float]]:
    if args.workload == "chat":
        return "conversations", [float(args.conversations)]
    if args.request_rate:
        return "rate", args.request_rate
    return "concurrency", [float(int(c)) for c in args.concurrency]


async def run(args: argparse.Namespace, targets: list[Target], prompts: list[Prompt],
              convs: list[Conversation], offline: OfflineEngine | None = None) -> tuple[list[dict[str, Any]], list]:
    """Every level against every target in turn (and `offline`, interleaved with them); returns (summaries, records)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.deadline
    cfg = load.LoadConfig(endpoint=args.endpoint, temperature=args.temperature,
                          request_timeout=args.request_timeout, progress=not args.no_progress)
    kind, levels = _levels(args)
    connections = int(max(levels)) if kind != "rate" else args.num_requests
    limits = httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4)
    summaries, records = [], []
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits, trust_env=False) as http:
        for target, name in zip(targets, (args.model_name, args.peer_model_name)):
            target.model = name or await served_model(http, target)
            if not args.no_warmup:
                warm = await load.warm_up(http, target, cfg, prompts[0] if prompts else Prompt("Hello", 8))
                if not warm.ok:
                    raise RuntimeError(f"the warm-up request to {target.url} failed: {warm.error}")
        per_level = args.num_requests_per_level or [args.num_requests] * len(levels)
        for level, num_requests in zip(levels, (int(n) for n in per_level)):
            if loop.time() >= deadline:
                break  # the deadline has passed: the levels left are not run
            befores = {target.name: await scrape_split(http, target) for target in targets}
            runs: dict[str, list[load.LevelRun]] = {}
            first = 0
            for size in _round_sizes(num_requests, int(level), args.offline_rounds if offline is not None else 1):
                for target in targets:
                    if kind == "conversations":
                        part = await load.chat(http, target, cfg, convs, args.output_len, deadline)
                    elif kind == "rate":
                        part = await load.open_loop(http, target, cfg, prompts, args.num_requests, level, args.seed,
                                                    deadline)
                    else:
                        part = await load.closed_loop(http, target, cfg, prompts, size, int(level), deadline, first)
                    runs.setdefault(target.name, []).append(part)
                if offline is not None:  # the servers are idle meanwhile: their OpenMP threads sleep
                    part = await asyncio.to_thread(offline_loop, offline, prompts, size, int(level), args.temperature,
                                                   warm_up=first == 0 and not args.no_warmup, first=first)
                    runs.setdefault(OFFLINE, []).append(part)
                first += size
            for name, parts in runs.items():
                target = next((t for t in targets if t.name == name), None)
                split = None if target is None else split_means(befores[name], await scrape_split(http, target))
                result = load.merged(parts)
                summaries.append(summarize(name, kind, level, result, split, slo_ttft_ms=args.slo_ttft_ms,
                                           slo_tpot_ms=args.slo_tpot_ms))
                if name == OFFLINE:
                    summaries[-1]["paired"] = paired_ratios(runs["pagoda"], parts)
                records += result.records
    return summaries, records
