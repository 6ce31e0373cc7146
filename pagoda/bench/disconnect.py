"""`pagoda bench disconnect`: the disconnect bill, per protocol path, on a live server.

For each path (every endpoint the server registers, stream and not: the four
built-in protocols, and the installed plugins' that PAGODA_PLUGINS allows) a
client asks for --max-tokens tokens over a plain socket, its body built by the
endpoint's client half, and closes it --hangup-after seconds in. The bill is read from the engine, which this process holds:

    tokens at close      the request's output tokens when the socket closed
    tokens after close   what it generated after that: the step in flight at
                         the close, plus every step the abort did not stop
    steps after close    engine steps begun after the close (all of them this
                         request's: it is alone on the server)
    close -> idle        wall time from the close to the engine loop saying it
                         is idle (asked of the loop itself)

Target: at most 2 decode steps of work after the close, on every path: at most 2 x the tokens one step can
make for one request (1, or 1 + its drafts where speculative decoding runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from pagoda.core.machine import cpu_facts
from pagoda.plugins.client import ClientRequest
from pagoda.plugins.manager import ALLOW_ENV
from pagoda.plugins.protocol import Endpoint

PROMPT = "Tell me a long story about a pagoda."
TARGET_STEPS = 2  # decode steps of work after the close


@dataclass
class PathBill:
    path: str
    stream: bool
    phase_at_close: str  # queued | prefill | decode | finished
    tokens_at_close: int
    tokens_spent: int
    tokens_after_close: int
    steps_after_close: int
    close_to_idle_ms: float
    finish_reason: str
    tokens_per_step: int = 1  # the most one step makes for this request: 1 + its drafts under speculation

    @property
    def within_target(self) -> bool:
        return self.finish_reason == "abort" and self.tokens_after_close <= TARGET_STEPS * self.tokens_per_step


def request_bytes(host: str, endpoint: Endpoint, max_tokens: int, stream: bool) -> bytes:
    """A greedy request that would run its whole budget (ignore_eos), as raw HTTP/1.1."""
    ask = ClientRequest(PROMPT, max_tokens, stream=stream, temperature=0.0, ignore_eos=True)
    data = json.dumps(endpoint.client_request(ask)).encode()
    head = (f"POST {endpoint.path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


def phase_of(request: Any) -> str:
    """Where the request was when its client left (a step in flight counts as begun)."""
    from pagoda.core.request import RequestStatus

    if request is None or request.is_finished:
        return "finished"
    if request.status is RequestStatus.WAITING:
        return "queued"
    return "decode" if request.num_output_tokens else "prefill"


def tokens_per_step(engine: Any) -> int:
    """The most tokens one step makes for one greedy request: 1, plus its drafts when speculation runs."""
    spec = engine.speculation.config
    return 1 + (spec.num_speculative_tokens if spec is not None else 0)


def measure_path(live: Any, endpoint: Endpoint, stream: bool, max_tokens: int, hangup_after: float) -> PathBill:
    """One request on an idle server, its client closing `hangup_after` seconds in."""
    async_engine = live.async_engine
    engine = async_engine.engine
    asyncio.run(async_engine.wait_until_idle())
    known = set(engine.requests)
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sent = time.monotonic()
    sock.sendall(request_bytes(host, endpoint, max_tokens, stream))
    time.sleep(max(0.0, sent + hangup_after - time.monotonic()))
    # Snapshots from this thread: plain ints, good to one step (the step in flight is counted as begun).
    request = next((r for rid, r in dict(engine.requests).items() if rid not in known), None)
    phase = phase_of(request)
    at_close = request.num_output_tokens if request is not None else 0
    steps_at_close = engine.counters.steps_total
    closed = time.monotonic()
    sock.close()
    asyncio.run(async_engine.wait_until_idle())
    idle = time.monotonic()
    if request is None:
        raise RuntimeError(f"{endpoint.path} stream={stream}: the request was not in the engine {hangup_after} s in")
    return PathBill(path=endpoint.path, stream=stream, phase_at_close=phase, tokens_at_close=at_close,
                    tokens_spent=request.num_output_tokens, tokens_after_close=request.num_output_tokens - at_close,
                    steps_after_close=engine.counters.steps_total - steps_at_close,
                    close_to_idle_ms=(idle - closed) * 1000, finish_reason=str(request.finish_reason.value),
                    tokens_per_step=tokens_per_step(engine))


def decode_ms_per_token(live: Any, tokens: int = 32) -> float:
    """Warm the server up and time a unary decode (ms per token, prefill included)."""
    import httpx

    body = {"model": "default", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    start = time.monotonic()
    httpx.post(f"{live.url}/v1/completions", json=body, timeout=600).raise_for_status()
    return (time.monotonic() - start) * 1000 / tokens


def table(bills: list[PathBill], max_tokens: int) -> str:
    lines = ["| path | stream | phase at close | tokens at close | tokens spent (of "
             f"{max_tokens}) | tokens after close | steps after close | close -> idle |",
             "|---|---|---|---|---|---|---|---|"]
    for b in bills:
        lines.append(f"| {b.path} | {'yes' if b.stream else 'no'} | {b.phase_at_close} | {b.tokens_at_close} | "
                     f"{b.tokens_spent} | {b.tokens_after_close} | {b.steps_after_close} | "
                     f"{b.close_to_idle_ms:.0f} ms |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagoda bench disconnect", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=800, help="what each departing client asks for")
    p.add_argument("--hangup-after", type=float, default=0.2, help="seconds from sending to closing the socket")
    p.add_argument("--repeats", type=int, default=3, help="runs per path; the table shows each path's worst")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = p.parse_args(argv)

    from pagoda.harness.live_server import live_server

    options = dict(device=args.device, dtype=args.dtype, num_blocks=args.num_blocks)
    # The plugins `pagoda serve` would load (PAGODA_PLUGINS unset: every installed one).
    environ = {k: v for k, v in os.environ.items() if k == ALLOW_ENV}
    with live_server(args.model, "default", environ=environ, **options) as live:
        ms_per_token = decode_ms_per_token(live)
        bills = []
        for endpoint in live.endpoints.values():
            for stream in (False, True):
                runs = [measure_path(live, endpoint, stream, args.max_tokens, args.hangup_after)
                        for _ in range(args.repeats)]
                bills.append(max(runs, key=lambda b: (b.tokens_after_close, b.close_to_idle_ms)))
        stats = live.assert_pool_whole()  # idle, audited and whole, asked of the engine loop
        device = str(getattr(live.async_engine.engine.runner, "device", args.device))
    summary = {"model": args.model, "device": device, "machine": cpu_facts().describe(),
               "ms_per_token": round(ms_per_token, 1), "max_tokens": args.max_tokens,
               "hangup_after_s": args.hangup_after, "target_steps_of_work_after_close": TARGET_STEPS,
               "pool_whole": stats["kv_blocks_free"] == stats["kv_blocks_total"],
               "all_within_target": all(b.within_target for b in bills),
               "paths": [asdict(b) | {"close_to_idle_ms": round(b.close_to_idle_ms, 1)} for b in bills]}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"model {summary['model']} on {device}, {summary['ms_per_token']} ms/token; each client asks for "
              f"{args.max_tokens} tokens and closes its socket {args.hangup_after} s in; worst of {args.repeats}")
        print(table(bills, args.max_tokens))
        print(f"pool whole afterwards: {summary['pool_whole']}; every path within {TARGET_STEPS} steps of work "
              f"after the close: {summary['all_within_target']}")
    return 0 if summary["all_within_target"] and summary["pool_whole"] else 1


if __name__ == "__main__":
    sys.exit(main())
