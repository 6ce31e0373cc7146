"""What `pagoda bench serve` reports: per-level summaries, the terminal table, the JSON file, the plots.

Records keep seconds; summaries give milliseconds. A level's duration runs
from its start to its last request's end, and req/s, output tok/s and goodput
divide by it. Goodput counts the requests that met every SLO given.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from pagoda.core.machine import cpu_facts
from pagoda.bench.serve.client import RequestRecord
from pagoda.bench.serve.load import LevelRun

# Columns of the table: (title, summary key, stat) where stat picks from a latency summary.
COLUMNS = (("req/s", "req_per_s", None), ("out tok/s", "out_tok_per_s", None),
           ("TTFT p50 ms", "ttft_ms", "p50"), ("TTFT p99 ms", "ttft_ms", "p99"),
           ("ITL p50 ms", "itl_ms", "p50"), ("ITL p99 ms", "itl_ms", "p99"),
           ("TPOT p50 ms", "tpot_ms", "p50"), ("e2e p50 ms", "e2e_ms", "p50"))
OTHERS = ("peer", "offline")  # what pagoda's rows are divided by: a second server, the same engine without HTTP


def latency_ms(values: list[float]) -> dict[str, float] | None:
    """mean, p50, p90, p99 (linear interpolation) of seconds, in ms; None for no values."""
    if not values:
        return None
    a = np.asarray(values, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "n": len(values)}


def meets_slo(r: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Succeeded, and within each SLO given (a one-token request has no TPOT to miss)."""
    if not r.ok:
        return False
    if slo_ttft_ms is not None and r.ttft * 1000.0 > slo_ttft_ms:
        return False
    return slo_tpot_ms is None or r.tpot is None or r.tpot * 1000.0 <= slo_tpot_ms


def summarize(server: str, kind: str, level: float, run: LevelRun, split: dict[str, float] | None, *,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """One level against one server, as numbers."""
    ok = [r for r in run.records if r.ok]
    duration = run.duration or math.inf
    summary: dict[str, Any] = {
        "server": server, "kind": kind, "level": level, "requests": len(run.records), "ok": len(ok),
        "failed": len(run.records) - len(ok), "deadline_hit": run.deadline_hit, "duration_s": run.duration,
        "req_per_s": len(ok) / duration, "out_tok_per_s": sum(r.output_tokens or 0 for r in ok) / duration,
        "ttft_ms": latency_ms([r.ttft for r in ok]), "itl_ms": latency_ms([g for r in ok for g in r.itl]),
        "tpot_ms": latency_ms([r.tpot for r in ok if r.tpot is not None]), "e2e_ms": latency_ms([r.e2e for r in ok]),
        "goodput_req_per_s": None,
        "client_cpu_ms_per_token": (run.client_cpu * 1000.0 / tokens
                                    if (tokens := sum(r.output_tokens or 0 for r in ok)) and run.client_cpu else None),
        "server_split_ms": None if split is None else {k: None if v is None else v * 1000.0 for k, v in split.items()},
        "errors": sorted({r.error for r in run.records if r.error})[:5],
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        summary["goodput_req_per_s"] = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in ok) / duration
    turns = sorted({r.turn for r in ok if r.turn is not None})
    if turns:
        summary["ttft_by_turn_ms"] = {str(t): latency_ms([r.ttft for r in ok if r.turn == t]) for t in turns}
        summary["prompt_tokens_by_turn"] = {str(t): float(np.mean([r.prompt_tokens or 0 for r in ok if r.turn == t]))
                                            for t in turns}
    return summary


def _value(summary: dict[str, Any], key: str, stat: str | None) -> float | None:
    v = summary.get(key)
    return v if stat is None else (v or {}).get(stat)


def ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """pagoda / peer for every column (above 1: pagoda is higher, which for a latency is worse)."""
    out = {}
    for title, key, stat in COLUMNS:
        a, b = _value(ours, key, stat), _value(peer, key, stat)
        out[title] = a / b if a is not None and b else None
    return out


def level_ratios(summaries: list[dict[str, Any]], other: str = "peer") -> dict[float, dict[str, float | None]]:
    """pagoda / `other` (the peer, or the offline engine) per level, for the levels both ran."""
    by = {(s["server"], s["level"]): s for s in summaries}
    return {level: ratios(by["pagoda", level], by[other, level])
            for level in sorted({s["level"] for s in summaries}) if ("pagoda", level) in by and (other, level) in by}


def _fmt(v: float | None, ratio: bool = False) -> str:
    if v is None:
        return "-"
    if ratio:
        return f"{v:.2f}x"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def table(summaries: list[dict[str, Any]], with_peer: bool) -> str:
    """The terminal table: a row per level (and per server, with a ratio row, when a peer ran)."""
    kind = summaries[0]["kind"] if summaries else "level"
    has_goodput = any(s["goodput_req_per_s"] is not None for s in summaries)
    has_split = any(s["server_split_ms"] for s in summaries)
    head = ([kind] + (["server"] if with_peer else []) + ["ok"] + [c[0] for c in COLUMNS]
            + (["goodput req/s"] if has_goodput else []) + (["queue / prefill / decode ms"] if has_split else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    all_ratios = {other: level_ratios(summaries, other) for other in OTHERS} if with_peer else {}
    for level in sorted({s["level"] for s in summaries}):
        rows = {s["server"]: s for s in summaries if s["level"] == level}
        for s in rows.values():
            cells = [f"{level:g}"] + ([s["server"]] if with_peer else []) + [f"{s['ok']}/{s['requests']}"]
            cells += [_fmt(_value(s, key, stat)) for _, key, stat in COLUMNS]
            if has_goodput:
                cells.append(_fmt(s["goodput_req_per_s"]))
            if has_split:
                split = s["server_split_ms"]
                cell = " / ".join(_fmt(split[k]) for k in ("queue", "prefill", "decode")) if split else "-"
                if split and "handoff" in split:  # the hops between the event loop and the engine thread
                    cell += (f" (handoff {_fmt(split['handoff'])},"
                             f" 1st-token delivery {_fmt(split.get('first_token_delivery'))})")
                cells.append(cell)
            lines.append("| " + " | ".join(cells) + " |")
        for other, by_level in all_ratios.items():
            if level in by_level:
                r = by_level[level]
                cells = [f"{level:g}", f"pagoda / {other}", ""] + [_fmt(r[c[0]], ratio=True) for c in COLUMNS]
                cells += [""] * (has_goodput + has_split)
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def turn_table(summaries: list[dict[str, Any]]) -> str:
    """TTFT per turn index (the chat workload): later turns resend a longer shared history."""
    lines = ["| server | turn | prompt tokens | TTFT p50 ms | TTFT p99 ms |", "|---|---|---|---|---|"]
    for s in summaries:
        for turn, lat in s.get("ttft_by_turn_ms", {}).items():
            lines.append(f"| {s['server']} | {turn} | {s['prompt_tokens_by_turn'][turn]:.0f} | {_fmt(lat['p50'])}"
                         f" | {_fmt(lat['p99'])} |")
    return "\n".join(lines)


def write_json(path: str | Path, config: dict[str, Any], summaries: list[dict[str, Any]],
               records: list[RequestRecord], baseline: dict[str, Any] | None = None) -> None:
    """The result file: the run's settings, every summary, the pagoda / peer ratios, every per-request record."""
    result = {"config": config, "machine": cpu_facts().describe(), "summaries": summaries,
              "ratios": [{"level": level, **r} for level, r in level_ratios(summaries).items()],
              "offline_ratios": [{"level": level, **r} for level, r in level_ratios(summaries, "offline").items()],
              "records": [r.to_json() for r in records]}
    if baseline is not None:
        result["baseline"] = baseline
    Path(path).write_text(json.dumps(result, indent=1))


def write_plots(plot_dir: str | Path, summaries: list[dict[str, Any]], records: list[RequestRecord]) -> list[Path]:
    """Throughput against the level, and TTFT / ITL CDFs, as PNGs; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    servers = sorted({s["server"] for s in summaries})
    kind = summaries[0]["kind"] if summaries else "level"
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for server in servers:
        rows = sorted((s for s in summaries if s["server"] == server), key=lambda s: s["level"])
        for ax, key in zip(axes, ("out_tok_per_s", "req_per_s")):
            ax.plot([s["level"] for s in rows], [s[key] for s in rows], marker="o", label=server)
    levels = sorted({s["level"] for s in summaries})
    for ax, title in zip(axes, ("output tokens/s", "requests/s")):
        ax.set_xlabel(kind)
        ax.set_ylabel(title)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [f"{v:g}" for v in levels])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend()
    written.append(_save(fig, out / "throughput.png"))
    for name, values in (("ttft", lambda r: [r.ttft]), ("itl", lambda r: r.itl)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for server in servers:
            for level in sorted({r.level for r in records if r.server == server}):
                xs = np.sort([v * 1000.0 for r in records if r.ok and r.server == server and r.level == level
                              for v in values(r)])
                if len(xs):
                    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"{server} {kind}={level:g}",
                            linestyle="-" if server == "pagoda" else "--")
        ax.set_xlabel(f"{name.upper()} ms")
        ax.set_ylabel("fraction of requests" if name == "ttft" else "fraction of gaps")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        written.append(_save(fig, out / f"{name}_cdf.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
