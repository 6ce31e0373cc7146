"""`pagoda bench serve --tenant-mix A:64,B:1`: noisy neighbours, live, each tenant with a key of its own.

    tenants    NAME:STREAMS each: a tenant with a random key and STREAMS clients in closed loops. The bench writes a
               keys file (each key's SHA-256, weight 1) and starts `pagoda serve --api-keys-file FILE
               --scheduling-policy P`, a fresh server for each P of --scheduling-policy (fcfs,fair unless given),
               so that nothing one policy left behind (queues, cached blocks) reaches the next
    neighbour  the quietest tenant (fewest streams; the last named on a tie). On each server it first runs alone
               for --num-requests (its TTFT alone, on the same server); then every tenant's loops run until the
               neighbour has finished --num-requests more, and the others' loops stop (what they have in flight
               is cancelled; the tokens it had streamed still count)
    pauses     --think-time S: each stream pauses before each request (exponential, mean S), as a client's own
               work between an answer and its next request does; 0 (the default): back to back
    report     per tenant: requests, TTFT p50/p90, generated tokens, tokens/s, share while active; for the
               neighbour its TTFT p50 over its TTFT alone

Share while active (the simulator's measure, seen from the client). A tenant is active from the start of each of
its requests to its end (the union of those spans); its share is its generated tokens over every tenant's
generated tokens inside those spans. A token is placed where its stream event reached the client (start + TTFT +
the gaps before it), and an event carries output_tokens / events tokens (more than one when a step's drafted
tokens were accepted); a stopped request counts one token per event it had streamed. The client sees a token a
little after the step that made it (the hand-off and the socket), alike for every tenant.

Fair share: what `fair` owes a tenant when each of its streams wants one token a step: max_running slots
water-filled over the tenants' streams (equal weights), its slots over the slots in use. One stream among 64
others' on 16 slots is owed 1/16, since one stream makes at most one token a step (drafts aside); a share of 40%
needs the slots themselves to be contested (2 slots: 1/2).

The neighbour's prompts alone and in the mix are different words (the same ones would be prefix-cache hits in
the mix and flatter its TTFT there); every prompt is drawn from a seeded generator of its own, so no two requests
of a tenant repeat a prompt either.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import hashlib
import json
import random
import re
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pagoda.core.machine import cpu_facts
from pagoda.bench.serve import load
from pagoda.bench.serve.client import RequestRecord, Target, served_model
from pagoda.bench.serve.report import latency_ms
from pagoda.bench.serve.server import pagoda_subprocess, serve_command
from pagoda.bench.serve.workloads import Prompt, words
from pagoda.core.engine_config import EngineConfig

DEFAULT_POLICIES = ("fcfs", "fair")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")  # what a keys file accepts as a tenant's name
_MAX_RUNNING = re.compile(r"--max-running(?:=(\d+))?$")


@dataclass(frozen=True)
class TenantLoad:
    """One tenant of the mix: its name (in the keys file) and its closed-loop streams."""

    name: str
    streams: int


def parse_tenant_mix(text: str) -> tuple[TenantLoad, ...]:
    """`A:64,B:1` -> the tenants, in order; at least two, distinct names, at least one stream each."""
    tenants = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, streams = part.rpartition(":")
        if not sep or not _NAME.fullmatch(name) or not streams.isdigit() or int(streams) < 1:
            raise argparse.ArgumentTypeError(f"a tenant is NAME:STREAMS (NAME of letters, digits and _.:-,"
                                             f" STREAMS >= 1), got {part!r}")
        tenants.append(TenantLoad(name, int(streams)))
    names = [t.name for t in tenants]
    if len(tenants) < 2 or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a tenant mix is two or more tenants of distinct names, got {text!r}")
    return tuple(tenants)


def parse_policies(text: str) -> tuple[str, ...]:
    """`fcfs,fair` -> the scheduling policies, each measured on a server of its own (the server refuses a name it
    does not know, naming those it does)."""
    policies = tuple(p.strip() for p in text.split(",") if p.strip())
    if not policies or len(set(policies)) != len(policies):
        raise argparse.ArgumentTypeError(f"expected scheduling policy names separated by commas, got {text!r}")
    return policies


def neighbour(tenants: Iterable[TenantLoad]) -> str:
    """The quietest tenant: fewest streams, the last named on a tie (`A:1,B:1`: B)."""
    tenants = list(tenants)
    return min(reversed(tenants), key=lambda t: t.streams).name


def write_keys_file(path: Path, names: Iterable[str]) -> dict[str, str]:
    """A keys file of the tenants at weight 1, each a fresh random key stored as its SHA-256; returns the keys."""
    keys = {name: secrets.token_urlsafe(32) for name in names}
    tenants = [{"name": name, "key_sha256": hashlib.sha256(key.encode()).hexdigest(), "weight": 1}
               for name, key in keys.items()]
    path.write_text(json.dumps({"tenants": tenants}, indent=1))
    path.chmod(0o600)
    return keys


def max_running(cmd: list[str]) -> int:
    """The --max-running a `pagoda serve` command line ends with (the last one wins), else the engine's default."""
    value = EngineConfig.max_running
    for i, arg in enumerate(cmd):
        if m := _MAX_RUNNING.match(arg):
            value = int(m.group(1) or cmd[i + 1])
    return value


def fair_slots(streams: dict[str, int], slots: int) -> dict[str, float]:
    """Equal-weight max-min shares of `slots` over the tenants' streams (each stream wants one slot)."""
    out, left = {}, float(slots)
    ordered = sorted(streams.items(), key=lambda kv: kv[1])
    for i, (name, want) in enumerate(ordered):
        out[name] = min(float(want), left / (len(ordered) - i))
        left -= out[name]
    return out


def fair_share(streams: dict[str, int], slots: int) -> dict[str, float]:
    """Each tenant's share of a step's tokens under its fair slots (one token per running stream a step)."""
    got = fair_slots(streams, slots)
    used = sum(got.values())
    return {name: n / used for name, n in got.items()}


def token_events(record: RequestRecord) -> list[tuple[float, float]]:
    """(when, tokens) of each stream event of a request, on its level's clock."""
    if record.ttft is None:
        return []
    events = 1 + len(record.itl)
    per_event = record.output_tokens / events if record.ok and record.output_tokens else 1.0
    t = record.start + record.ttft
    out = [(t, per_event)]
    for gap in record.itl:
        t += gap
        out.append((t, per_event))
    return out


def active_spans(records: Iterable[RequestRecord], end: float) -> list[tuple[float, float]]:
    """The union of the requests' [start, end] spans, merged and sorted; a request that did not finish ends at its
    last event, or at `end` (the loops' end) when nothing streamed."""
    spans = []
    for r in records:
        if r.e2e is not None:
            spans.append((r.start, r.start + r.e2e))
        else:
            events = token_events(r)
            spans.append((r.start, events[-1][0] if events else end))
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def tokens_within(records: Iterable[RequestRecord], spans: list[tuple[float, float]]) -> float:
    """Tokens of `records` whose events fall inside one of the (merged, sorted) spans."""
    starts = [a for a, _ in spans]
    total = 0.0
    for r in records:
        for t, n in token_events(r):
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t <= spans[i][1]:
                total += n
    return total


def share_while_active(by_tenant: dict[str, list[RequestRecord]], tenant: str, end: float) -> float | None:
    """`tenant`'s generated tokens over everyone's, within the spans it had a request in flight."""
    spans = active_spans(by_tenant[tenant], end)
    everyone = sum(tokens_within(records, spans) for records in by_tenant.values())
    return tokens_within(by_tenant[tenant], spans) / everyone if everyone else None


def _p50(lat: dict[str, float] | None) -> float | None:
    return None if lat is None else lat["p50"]


def summarize(policy: str, alone: load.LevelRun, mix: dict[str, load.LevelRun], streams: dict[str, int],
              until: str, slots: int, health: tuple[dict | None, dict | None] = (None, None)) -> dict[str, Any]:
    """One policy's server: the neighbour alone, and every tenant in the mix."""
    duration = max(run.duration for run in mix.values()) or float("inf")
    by_tenant = {name: run.records for name, run in mix.items()}
    owed = fair_share(streams, slots)
    tenants = {}
    for name, records in by_tenant.items():
        ok = [r for r in records if r.ok]
        tokens = sum(n for r in records for _, n in token_events(r))
        tenants[name] = {
            "streams": streams[name], "requests": len(ok),
            "stopped": sum(r.error == load.STOPPED for r in records),
            "failed": sum(not r.ok and r.error != load.STOPPED for r in records),
            "ttft_ms": latency_ms([r.ttft for r in ok]), "generated_tokens": tokens,
            "out_tok_per_s": tokens / duration, "share_while_active": share_while_active(by_tenant, name, duration),
            "fair_share": owed[name],
        }
    alone_ok = [r for r in alone.records if r.ok]
    alone_ttft = latency_ms([r.ttft for r in alone_ok])
    b = tenants[until]
    ratio = _p50(b["ttft_ms"]) / _p50(alone_ttft) if _p50(b["ttft_ms"]) and _p50(alone_ttft) else None
    errors = sorted({r.error for run in (alone, *mix.values()) for r in run.records
                     if r.error and r.error != load.STOPPED})
    before, after = health
    server = None
    if before and after:  # the server's own counters over the mix (its /health)
        server = {"steps": after["steps_total"] - before["steps_total"],
                  "generated_tokens": after["generated_tokens_total"] - before["generated_tokens_total"],
                  "preemptions": after["preemptions_total"] - before["preemptions_total"],
                  "peak_running": after["peak_running"]}
    return {
        "policy": policy, "neighbour": until, "max_running": slots, "duration_s": duration,
        "deadline_hit": alone.deadline_hit or any(run.deadline_hit for run in mix.values()),
        "alone": {"requests": len(alone_ok), "failed": len(alone.records) - len(alone_ok), "ttft_ms": alone_ttft},
        "tenants": tenants, "neighbour_ttft_ratio": ratio,
        "others_out_tok_per_s": sum(t["out_tok_per_s"] for name, t in tenants.items() if name != until),
        "server": server, "errors": errors[:5],
    }


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    return (f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}") + unit


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def table(summaries: list[dict[str, Any]]) -> str:
    """Per policy and tenant, then the neighbour's line per policy."""
    head = ("policy", "tenant", "streams", "requests", "stopped", "TTFT p50 ms", "TTFT p90 ms", "tokens", "tok/s",
            "share while active", "fair share")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        for name, t in s["tenants"].items():
            lat = t["ttft_ms"] or {}
            lines.append(f"| {s['policy']} | {name} | {t['streams']} | {t['requests']} | {t['stopped']}"
                         f" | {_fmt(lat.get('p50'))} | {_fmt(lat.get('p90'))} | {t['generated_tokens']:.0f}"
                         f" | {_fmt(t['out_tok_per_s'])} | {_pct(t['share_while_active'])} | {_pct(t['fair_share'])} |")
    until = summaries[0]["neighbour"] if summaries else "B"
    head = ("policy", f"{until} alone TTFT p50 ms", f"{until} TTFT p50 ms", "x alone", f"{until} share while active",
            f"{until} fair share", "others' tok/s", "preemptions")
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        b = s["tenants"][until]
        ratio = s["neighbour_ttft_ratio"]
        lines.append(f"| {s['policy']} | {_fmt(_p50(s['alone']['ttft_ms']))} | {_fmt(_p50(b['ttft_ms']))}"
                     f" | {'-' if ratio is None else f'{ratio:.2f}x'} | {_pct(b['share_while_active'])}"
                     f" | {_pct(b['fair_share'])} | {_fmt(s['others_out_tok_per_s'])}"
                     f" | {s['server']['preemptions'] if s['server'] else '-'} |")
    return "\n".join(lines)


def write_plot(plot_dir: str | Path, summaries: list[dict[str, Any]], records: list[dict[str, Any]]) -> Path | None:
    """tenant_mix.png: the neighbour's TTFT per request over the mix, its TTFT over alone and its share per policy
    against the targets (2x, 40%); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return None
    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    until = summaries[0]["neighbour"] if summaries else "B"
    policies = [s["policy"] for s in summaries]
    fig, (ax_t, ax_r, ax_s) = plt.subplots(1, 3, figsize=(13, 4), gridspec_kw={"width_ratios": [2, 1, 1]})
    for k, s in enumerate(summaries):
        color = f"C{k}"
        mine = [r for r in records if r["policy"] == s["policy"] and r["phase"] == "mix" and r["tenant"] == until
                and r["ok"]]
        ax_t.plot([r["start"] for r in mine], [r["ttft"] * 1000.0 for r in mine], marker="o", color=color,
                  label=f"{s['policy']}: in the mix")
        if (alone := _p50(s["alone"]["ttft_ms"])) is not None:
            ax_t.axhline(alone, color=color, linestyle="--", linewidth=1, label=f"{s['policy']}: alone (p50)")
    ax_t.set_yscale("log")
    ax_t.set_xlabel("request start, s into the mix")
    ax_t.set_ylabel(f"{until}'s TTFT ms")
    ax_t.legend(fontsize="small")
    ratios = [s["neighbour_ttft_ratio"] or 0.0 for s in summaries]
    bars = ax_r.bar(policies, ratios, color=[f"C{k}" for k in range(len(policies))])
    ax_r.bar_label(bars, [f"{r:.3g}x" for r in ratios])
    ax_r.axhline(2.0, color="black", linestyle=":", label="target (fair): <= 2x")
    ax_r.set_yscale("log")
    ax_r.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_r.set_ylim(0.5, max([4.0, *ratios]) * 2)
    ax_r.set_ylabel(f"{until}'s TTFT p50 / alone")
    ax_r.legend(fontsize="small")
    shares = [100 * (s["tenants"][until]["share_while_active"] or 0.0) for s in summaries]
    bars = ax_s.bar(policies, shares, color=[f"C{k}" for k in range(len(policies))])
    ax_s.bar_label(bars, [f"{v:.1f}%" for v in shares])
    ax_s.scatter(policies, [100 * s["tenants"][until]["fair_share"] for s in summaries], marker="_", s=600,
                 color="black", zorder=3, label="fair share (slots)")
    ax_s.axhline(40.0, color="black", linestyle=":", label="target (fair): >= 40%")
    ax_s.set_ylim(0, 100)
    ax_s.set_ylabel(f"{until}'s % of tokens while active")
    ax_s.legend(fontsize="small")
    for ax in (ax_t, ax_r, ax_s):
        ax.grid(True, alpha=0.3)
    mix = ", ".join(f"{n}:{t['streams']}" for n, t in summaries[0]["tenants"].items()) if summaries else ""
    fig.suptitle(f"tenant mix {mix}, max running {summaries[0]['max_running'] if summaries else '-'}")
    fig.tight_layout()
    path = out / "tenant_mix.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def prompts(seed: int, phase: str, input_len: int, output_len: int) -> Callable[[str, int], Prompt]:
    """Request i of tenant t in `phase`: words of a generator seeded by all three, so no prompt repeats."""
    return lambda tenant, i: Prompt(words(input_len, random.Random(f"{seed}:{phase}:{tenant}:{i}")), output_len)


def pauses(seed: int, phase: str, think_s: float) -> Callable[[str, int], float] | None:
    """Before request i of tenant t in `phase`: an exponential pause of mean `think_s` (None when 0), seeded by
    all three, so both policies' servers see the same pauses."""
    if think_s <= 0:
        return None
    return lambda tenant, i: random.Random(f"{seed}:think:{phase}:{tenant}:{i}").expovariate(1 / think_s)


async def _health(http: httpx.AsyncClient, url: str) -> dict | None:
    try:
        resp = await http.get(url + "/health", timeout=30)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def measure(args: argparse.Namespace, url: str, policy: str, keys: dict[str, str], streams: dict[str, int],
                  slots: int, budget: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One server: each key warmed up, the neighbour alone, then the mix; returns (summary, records as JSON)."""
    until = neighbour(TenantLoad(n, s) for n, s in streams.items())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget
    cfg = load.LoadConfig(endpoint=args.endpoint, temperature=args.temperature, request_timeout=args.request_timeout,
                          progress=not args.no_progress)
    connections = sum(streams.values()) + 4
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits, trust_env=False) as http:
        targets = {name: Target("pagoda", url, api_key=key) for name, key in keys.items()}
        model = args.model_name or await served_model(http, targets[until])
        for target in targets.values():
            target.model = model
        if not args.no_warmup:
            for name, target in targets.items():  # every key once: a key the server refuses fails here
                warm = await load.warm_up(http, target, cfg, Prompt("Hello", 8))
                if not warm.ok:
                    raise RuntimeError(f"the warm-up request of tenant {name} to {url} failed: {warm.error}")
        alone = await load.tenant_loops(http, {until: targets[until]}, {until: streams[until]}, cfg,
                                        prompts(args.seed, "alone", args.input_len, args.output_len), until,
                                        args.num_requests, deadline, pauses(args.seed, "alone", args.think_time))
        before = await _health(http, url)
        mix = await load.tenant_loops(http, targets, streams, cfg,
                                      prompts(args.seed, "mix", args.input_len, args.output_len), until,
                                      args.num_requests, deadline, pauses(args.seed, "mix", args.think_time))
        after = await _health(http, url)
    summary = summarize(policy, alone[until], mix, streams, until, slots, (before, after))
    records = [{"policy": policy, "phase": phase, **r.to_json()}
               for phase, runs in (("alone", alone), ("mix", mix)) for run in runs.values() for r in run.records]
    return summary, records


def main(args: argparse.Namespace) -> int:
    """Every policy on a fresh server with the same keys; prints the tables, writes --json and --plot-dir."""
    streams = {t.name: t.streams for t in args.tenant_mix}
    policies = args.scheduling_policy or DEFAULT_POLICIES
    summaries: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="pagoda-bench-keys-") as tmp:
            keys_file = Path(tmp) / "keys.json"
            keys = write_keys_file(keys_file, streams)
            for n, policy in enumerate(policies):
                left = args.deadline - (time.monotonic() - started)
                if left <= 0:
                    break  # the deadline has passed: the policies left are not run
                cmd = serve_command(args.model, dtype=args.dtype, quantization=args.quantization,
                                    num_blocks=args.num_blocks, max_running=args.max_running,
                                    extra=["--api-keys-file", str(keys_file), "--scheduling-policy", policy,
                                           *args.server_arg])
                with pagoda_subprocess(cmd, args.server_ready_timeout) as url:
                    # each policy left gets an even part of the time left
                    summary, recs = asyncio.run(measure(args, url.rstrip("/"), policy, keys, streams,
                                                        max_running(cmd), left / (len(policies) - n)))
                summaries.append(summary)
                records += recs
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"pagoda bench serve: {exc}", file=sys.stderr)
        return 2
    print(table(summaries))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("api_key", "peer_api_key")}
        config["tenant_mix"] = streams
        Path(args.json).write_text(json.dumps({"config": config, "machine": cpu_facts().describe(), "summaries": summaries, "records": records},
                                              indent=1))
    if args.plot_dir:
        path = write_plot(args.plot_dir, summaries, records) if summaries else None
        print(f"plots: {path if path else 'skipped (matplotlib is not installed)'}")
    failed = [s for s in summaries if s["errors"] or s["deadline_hit"]]
    for s in failed:
        print(f"{s['policy']}: {'the run deadline cut it short; ' if s['deadline_hit'] else ''}{s['errors']}",
              file=sys.stderr)
    return 1 if failed or len(summaries) < len(policies) else 0
