"""`pagoda bench soak`: many clients for a fixed time against a live server, then the books are checked.

    clients    --clients (64) loops on loopback, each sending one request after another: a random
               registered protocol (each endpoint's client half), stream or unary, greedy or seeded;
               --hangup-fraction (0.3) of them hang up at a random point; --hostile-fraction (0.05)
               are malformed bodies, which must get a 4xx
    watchers   /health polled every 100 ms on its own thread (every answer must be 200; its latency
               p50/p99 reported); the server process's resident memory sampled every second
    the end    the engine idle, its ledger audit clean and the pool whole; a sample of the completed
               answers rerun alone, one at a time, must be identical; RSS after warm-up (the first
               third) must not grow by more than --rss-slack-mib

With --replicas N (N > 1) the clients talk to a `pagoda router` (--router-policy) in front of N replicas, all in
this process on loopback ports: the same clients, hang-ups and hostile bodies, through the router; at the end
every replica's engine is idle, audited and its pool whole, and the solo reruns go through the router too.

Prints one JSON object; exit status 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import re
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import psutil

from pagoda.core.machine import cpu_facts
from pagoda.core.routing import POLICIES
from pagoda.harness.crowd_client import ClientOutcome, run_client
from pagoda.harness.live_server import LiveServer, live_server
from pagoda.model.hub import resolve_model
from pagoda.simulator.crowd import ClientPlan

PROMPTS = ("Tell me about pagodas.", "Write a haiku about rain.", "What is a paged KV cache?",
           "List three rivers in Asia.", "Explain continuous batching in one sentence.", "Say hello.")
HOSTILE_BODIES = (b"{not json", b"[]", b'{"model": 3}', b'{"messages": "nope", "max_tokens": -1}',
                  b'{"prompt": {"a": 1}, "max_tokens": "many"}')


@dataclass
class SoakStats:
    """What the clients and watchers saw."""

    outcomes: list[tuple[ClientPlan, ClientOutcome]] = field(default_factory=list)
    hostile_statuses: list[int] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)
    # the same moments asked as a loop command (answered between two steps): /health's former path, the baseline
    command_ms: list[float] = field(default_factory=list)
    health_failures: list[str] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)


def _plan(rng: random.Random, i: int, protocols: list[str], max_tokens: int, hangup: float) -> ClientPlan:
    seeded = rng.random() < 0.5
    return ClientPlan(client_id=f"c{i}", prompt_text=rng.choice(PROMPTS), max_tokens=rng.randint(4, max_tokens),
                      temperature=0.8 if seeded else 0.0, seed=rng.randrange(1 << 30) if seeded else None,
                      stream=rng.random() < 0.5, protocol=rng.choice(protocols),
                      hangup_after=rng.uniform(0.0, 1.5) if rng.random() < hangup else None)


async def _client(live: LiveServer, http: httpx.AsyncClient, rng: random.Random, deadline: float, args,
                  stats: SoakStats, counter: list[int]) -> None:
    protocols = sorted(live.endpoints)
    while time.monotonic() < deadline:
        counter[0] += 1
        if rng.random() < args.hostile_fraction:
            endpoint = live.endpoints[rng.choice(protocols)]
            r = await http.post(endpoint.path, content=rng.choice(HOSTILE_BODIES),
                                headers={"content-type": "application/json"})
            stats.hostile_statuses.append(r.status_code)
            continue
        plan = _plan(rng, counter[0], protocols, args.max_tokens, args.hangup_fraction)
        stats.outcomes.append((plan, await run_client(http, plan, live.model_name, live.endpoints)))


def _watch_command(live: LiveServer, stop: threading.Event, stats: SoakStats) -> None:
    """The stats asked as a loop command every 100 ms (the baseline), on a thread of its own."""
    while not stop.wait(0.1):
        t0 = time.perf_counter()
        asyncio.run(asyncio.wait_for(live.async_engine.stats(), 60))
        stats.command_ms.append((time.perf_counter() - t0) * 1000)


def _watch(live: LiveServer, pid: int, stop: threading.Event, stats: SoakStats) -> None:
    """/health every 100 ms and RSS every second, until `stop` is set."""
    process, next_rss = psutil.Process(pid), 0.0
    with httpx.Client(base_url=live.url, timeout=30) as http:
        while not stop.wait(0.1):
            t0 = time.perf_counter()
            try:
                r = http.get("/health")
                if r.status_code != 200:
                    stats.health_failures.append(f"HTTP {r.status_code}: {r.text[:200]}")
            except httpx.HTTPError as exc:
                stats.health_failures.append(repr(exc))
            stats.health_ms.append((time.perf_counter() - t0) * 1000)
            if time.monotonic() >= next_rss:
                stats.rss_mib.append(process.memory_info().rss / 2**20)
                next_rss = time.monotonic() + 1.0


async def soak(live: LiveServer, args, replicas: list[LiveServer] | None = None) -> dict:
    """Run the clients for `args.duration` seconds against `live`, then check the books of `replicas` (default:
    `live` itself; a router's soak passes the servers behind it); returns the report."""
    replicas = replicas or [live]
    stats, stop = SoakStats(), threading.Event()
    watcher = threading.Thread(target=_watch, args=(live, psutil.Process().pid, stop, stats), daemon=True)
    watcher.start()
    baseline = threading.Thread(target=_watch_command, args=(live, stop, stats), daemon=True)
    baseline.start()
    deadline = time.monotonic() + args.duration
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients)
    counter = [0]
    async with httpx.AsyncClient(base_url=live.url, timeout=300, limits=limits) as http:
        await asyncio.gather(*(_client(live, http, random.Random(args.seed * 1000 + i), deadline, args, stats,
                                       counter) for i in range(args.clients)))
        pools = []
        for replica in replicas:
            await asyncio.wait_for(replica.async_engine.wait_until_idle(), 120)
        stop.set()
        watcher.join(30)
        baseline.join(60)
        for replica in replicas:
            await replica.async_engine.audit()
            pools.append(await replica.async_engine.stats())
        mismatches = await _solo_reruns(live, http, stats, args)
    return _report(stats, pools, mismatches, args)


async def _solo_reruns(live: LiveServer, http: httpx.AsyncClient, stats: SoakStats, args) -> list[str]:
    """Rerun a sample of the completed answers alone; the ids of those that differ."""
    completed = [(p, o) for p, o in stats.outcomes if o.status == "completed" and o.finish_reason is not None]
    sample = random.Random(args.seed).sample(completed, min(args.solo_sample, len(completed)))
    mismatches = []
    for plan, outcome in sample:
        alone = await run_client(http, plan, live.model_name, live.endpoints)
        if alone.text != outcome.text:
            mismatches.append(plan.client_id)
    return mismatches


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def _report(stats: SoakStats, pools: list[dict], mismatches: list[str], args) -> dict:
    by_status: dict[str, int] = {}
    for _, outcome in stats.outcomes:
        by_status[outcome.status] = by_status.get(outcome.status, 0) + 1
    failed = [o.error for _, o in stats.outcomes if o.status == "failed"][:5]
    rss = stats.rss_mib
    warm = rss[len(rss) // 3:]
    rss_growth = round(max(warm) - warm[0], 1) if len(warm) >= 2 else 0.0
    server_errors = [o.error for _, o in stats.outcomes if o.error and re.search(r"\b5\d\d\b", o.error)]
    checks = {
        "audit_clean_and_pool_whole": all(pool["running"] == 0 and pool["waiting"] == 0
                                          and pool["kv_blocks_free"] == pool["kv_blocks_total"] for pool in pools),
        "no_failed_requests": by_status.get("failed", 0) == 0,
        "no_5xx": not server_errors and all(s < 500 for s in stats.hostile_statuses),
        "hostile_all_4xx": all(400 <= s < 500 for s in stats.hostile_statuses),
        "health_always_200": not stats.health_failures,
        "solo_identical": not mismatches,
        "rss_flat": rss_growth <= args.rss_slack_mib,
    }
    return {
        "duration_seconds": args.duration, "clients": args.clients, "requests": len(stats.outcomes),
        "by_status": by_status, "hostile": len(stats.hostile_statuses),
        "hostile_statuses": sorted(set(stats.hostile_statuses)),
        "solo_checked": min(args.solo_sample, by_status.get("completed", 0)), "solo_mismatches": mismatches,
        "health": {"samples": len(stats.health_ms), "p50_ms": _percentile(stats.health_ms, 0.5),
                   "p99_ms": _percentile(stats.health_ms, 0.99), "failures": stats.health_failures[:5],
                   "command_p50_ms": _percentile(stats.command_ms, 0.5),
                   "command_p99_ms": _percentile(stats.command_ms, 0.99)},
        "rss_mib": {"first": round(rss[0], 1) if rss else None, "after_warmup": round(warm[0], 1) if warm else None,
                    "last": round(rss[-1], 1) if rss else None, "growth_after_warmup": rss_growth,
                    "mean": round(statistics.mean(rss), 1) if rss else None},
        "replicas": len(pools),
        "pool": {"total": sum(p["kv_blocks_total"] for p in pools), "free": sum(p["kv_blocks_free"] for p in pools)},
        "pools": [{"total": p["kv_blocks_total"], "free": p["kv_blocks_free"], "requests": p["requests_total"]}
                  for p in pools],
        "preemptions_total": sum(p["preemptions_total"] for p in pools),
        "aborted_total": sum(p["aborted_total"] for p in pools),
        "failed_examples": failed, "checks": checks, "ok": all(checks.values()),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda bench soak", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="'default' or a Hugging Face directory")
    p.add_argument("--duration", type=float, default=120.0, help="seconds the clients run")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--hangup-fraction", type=float, default=0.3)
    p.add_argument("--hostile-fraction", type=float, default=0.05)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--solo-sample", type=int, default=32, help="completed answers rerun alone")
    p.add_argument("--rss-slack-mib", type=float, default=64.0, help="RSS growth allowed after warm-up")
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none", help="the weight format (auto: a GGUF's own blocks on a CPU)")
    p.add_argument("--no-cpu-graphs", dest="cpu_graphs", action="store_false",
                   help="every CPU step eagerly (default: decode steps replay CPU step graphs where they can)")
    p.add_argument("--replicas", type=int, default=1, help="more than 1: the clients go through a router to them")
    p.add_argument("--router-policy", default="prefix", choices=POLICIES, help="with --replicas N: the router's")
    return p


@contextlib.contextmanager
def _router(replicas: list[LiveServer], policy: str) -> Iterator[str]:
    """`pagoda router` over the replicas, in this process; yields its URL."""
    from pagoda.api.server import BackgroundServer
    from pagoda.router.app import create_router_app
    from pagoda.router.settings import RouterSettings

    settings = RouterSettings(tuple(r.url for r in replicas), policy=policy, model_dir=str(resolve_model("default")),
                              health_timeout=30.0, log_level="warning")
    server = BackgroundServer(create_router_app(settings)).start()
    try:
        yield server.url
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.replicas < 1:
        raise SystemExit("pagoda bench soak: --replicas must be at least 1")
    model_dir = resolve_model(args.model)
    with contextlib.ExitStack() as stack:
        replicas = [stack.enter_context(live_server(
            model_dir, "soak", num_blocks=args.num_blocks, block_size=16, max_running=args.max_running,
            max_batched_tokens=256, max_model_len=args.max_model_len, device=args.device, dtype=args.dtype,
            quantization=args.quantization, cpu_graphs=args.cpu_graphs))
            for _ in range(args.replicas)]
        front = replicas[0]
        if args.replicas > 1:
            front = dataclasses.replace(front, url=stack.enter_context(_router(replicas, args.router_policy)))
        report = asyncio.run(soak(front, args, replicas))
    print(json.dumps({"machine": cpu_facts().describe(), **report}, indent=2))
    return 0 if report["ok"] else 1
