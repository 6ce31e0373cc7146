"""`pagoda bench router-read`: what reading prompts costs a `prefix` router, and whether its event loop stalls.

The router (`pagoda router --policy prefix`, a child process) renders and tokenizes every prompt before it
picks a replica. This bench gives it one replica address that nothing listens on (a loopback port taken from
the kernel and closed again), so every request is read, then refused with a 503 at once: what is measured is
the router's own work, with no replica's time in it. `--clients` loops send long chat prompts (`--words`
random words each, a different prompt every time) for `--seconds`; beside them a probe asks the router's own
`/metrics` every 10 ms, a request that reads no prompt, so its latency is how long the event loop that relays
every stream keeps it waiting. Reported: prompts read a second, a read request's latency, and the probe's
p50/p90/p99/max. Every loop stops at the deadline by itself; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from pagoda.core.machine import cpu_facts
from pagoda.bench.serve.report import latency_ms
from pagoda.bench.serve.server import ROUTER_READY, pagoda_subprocess
from pagoda.bench.serve.workloads import words

PROBE_INTERVAL_S = 0.01


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagoda bench router-read", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=4, help="concurrent loops sending prompts")
    p.add_argument("--seconds", type=float, default=20.0, help="how long the loops send")
    p.add_argument("--words", type=int, default=3000, help="random words in each chat prompt")
    p.add_argument("--model", default="default", help="the model whose tokenizer and chat template the router uses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=120.0)
    p.add_argument("--json", metavar="FILE", help="write the result as JSON")
    args = p.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0 or args.words < 1:
        p.error("--clients and --words must be at least 1, --seconds above 0")
    return args


def closed_port() -> int:
    """A loopback port the kernel handed out and that nothing listens on any more."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentiles_ms(values: list[float]) -> dict[str, float]:
    """bench serve's latency summary (mean, p50, p90, p99, n) and the worst, in ms."""
    return {**latency_ms(values), "max": 1000 * max(values)}


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    texts = [words(args.words, rng) for _ in range(args.clients * 4)]
    reads: list[float] = []
    probes: list[float] = []
    limits = httpx.Limits(max_connections=args.clients + 2)
    async with httpx.AsyncClient(timeout=60, limits=limits, trust_env=False) as http:
        end = time.monotonic() + args.seconds

        async def client(k: int) -> None:
            i = k
            while time.monotonic() < end:
                body = {"model": "m", "max_tokens": 1,
                        "messages": [{"role": "user", "content": f"{i}: {texts[i % len(texts)]}"}]}
                started = time.monotonic()
                response = await http.post(f"{url}/v1/chat/completions", json=body)
                if response.status_code != 503:
                    raise RuntimeError(f"expected the router's 503 (no replica), got {response.status_code}")
                reads.append(time.monotonic() - started)
                i += args.clients

        async def probe() -> None:
            while time.monotonic() < end:
                started = time.monotonic()
                await http.get(f"{url}/metrics")
                probes.append(time.monotonic() - started)
                await asyncio.sleep(PROBE_INTERVAL_S)

        await asyncio.gather(probe(), *(client(k) for k in range(args.clients)))
    return {"prompts_read": len(reads), "prompts_per_s": len(reads) / args.seconds,
            "read_ms": percentiles_ms(reads), "probe_ms": percentiles_ms(probes)}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cmd = [sys.executable, "-m", "pagoda", "router", "--replica", f"http://127.0.0.1:{closed_port()}",
           "--router-policy", "prefix", "--model", args.model, "--host", "127.0.0.1", "--port", "0",
           "--log-level", "warning", "--health-interval", "60"]
    try:
        with pagoda_subprocess(cmd, args.ready_timeout, ready=ROUTER_READY) as url:
            result = asyncio.run(measure(url.rstrip("/"), args))
    except (RuntimeError, OSError) as exc:
        print(f"pagoda bench router-read: {exc}", file=sys.stderr)
        return 2
    result = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "machine": cpu_facts().describe(), **result}
    probe, read = result["probe_ms"], result["read_ms"]
    print(f"{args.clients} clients, {args.words} words a prompt, {args.seconds:g} s: {result['prompts_read']} prompts read"
          f" ({result['prompts_per_s']:.1f}/s; a read request {read['p50']:.1f} ms p50); the loop's probe"
          f" p50 {probe['p50']:.1f} / p90 {probe['p90']:.1f} / p99 {probe['p99']:.1f} / max {probe['max']:.1f} ms"
          f" over {probe['n']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
