"""`pagoda bench serve --offline-baseline`: the same closed-loop load on an engine in this process, no HTTP.

    engine   the served model and engine options (`build_engine`), in the benchmark's own process;
             its KV pool sized for the level, not from free memory (the server holds its own)
    prompts  encoded as /v1/completions encodes them (the tokenizer's own special tokens), the same
             `max_tokens`, `ignore_eos` and temperature as the HTTP requests
    load     C "clients": C requests live at once, the next added right after a step that finished one
    timing   a request's clock starts when it is added; TTFT ends with the step that produced its first
             token, each later step that produced text adds an inter-token gap, as a client would see it

So a level's served / offline ratio is what the HTTP side (uvicorn, the handler, the hand-offs between the
engine thread and the event loop, SSE) costs on top of the engine's own steps.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from pagoda.bench.serve.client import RequestRecord
from pagoda.bench.serve.load import LevelRun
from pagoda.bench.serve.workloads import Prompt
from pagoda.core.sampling_params import SamplingParams

SERVER = "offline"  # the records' and summaries' server name


@dataclass
class OfflineEngine:
    """An engine and tokenizer made like the server's, for one run's levels."""

    engine: Any
    tokenizer: Any


def offline_engine(model: str, *, dtype: str | None, max_running: int | None, prompts: list[Prompt],
                   quantization: str | None = None,
                   max_concurrency: int, block_size: int = 16) -> OfflineEngine:
    """The served model's engine, with a pool that holds `max_concurrency` of the longest requests."""
    from pagoda.core.tokenizer import Tokenizer
    from pagoda.model.factory import EngineOptions, load_engine
    from pagoda.model.hub import resolve_model

    model_dir = resolve_model(model, progress=False)
    tokenizer = Tokenizer.from_dir(model_dir)
    longest = max(len(tokenizer.encode(p.text)) + p.max_tokens for p in prompts)
    options = EngineOptions(model=model, dtype=dtype or "auto", quantization=quantization or "auto", block_size=block_size,
                            num_blocks=max_concurrency * -(-longest // block_size) + 2,
                            **({"max_running": max_running} if max_running else {}))
    return OfflineEngine(load_engine(model_dir, tokenizer, options), tokenizer)


def closed_loop(offline: OfflineEngine, prompts: list[Prompt], num_requests: int, concurrency: int,
                temperature: float, *, warm_up: bool = True, first: int = 0) -> LevelRun:
    """`concurrency` requests live at once until `num_requests` ran (indices from `first`); one RequestRecord each."""
    engine = offline.engine
    if warm_up:  # first steps build kernels' plans; the served side had its warm-up request too
        engine.add_request("warm-up", offline.tokenizer.encode(prompts[0].text),
                           SamplingParams(max_tokens=min(prompts[0].max_tokens, 8), temperature=temperature,
                                          ignore_eos=True))
        for _ in engine.run():
            pass
    run = LevelRun()
    todo = deque(range(first, first + num_requests))
    live: dict[str, tuple[RequestRecord, float, list[float]]] = {}  # id -> (record, added at, [last text at])
    t0 = time.perf_counter()

    def add_next() -> None:
        i = todo.popleft()
        p = prompts[i % len(prompts)]
        now = time.perf_counter()
        record = RequestRecord(SERVER, float(concurrency), i, start=now - t0)
        run.records.append(record)
        params = SamplingParams(max_tokens=p.max_tokens, temperature=temperature, ignore_eos=True)
        engine.add_request(f"offline-{i}", offline.tokenizer.encode(p.text), params)
        live[f"offline-{i}"] = (record, now, [])

    while todo and len(live) < concurrency:
        add_next()
    for _ in range(100 * num_requests * max(p.max_tokens for p in prompts) + 100):  # bound: far past the work
        if not live:
            break
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            record, added, last = live[out.request_id]
            if out.new_text:
                if last:
                    record.itl.append(now - last[0])
                else:
                    record.ttft = now - added
                last[:] = [now]
            if out.finished:
                del live[out.request_id]
                record.e2e = now - added
                record.output_tokens = out.num_output_tokens
                record.prompt_tokens = out.num_prompt_tokens
                record.ok = record.ttft is not None and out.error is None
                record.error = out.error
                if todo:
                    add_next()
    run.duration = time.perf_counter() - t0
    return run


def paired_ratios(served: list[LevelRun], offline: list[LevelRun]) -> dict[str, Any]:
    """served / offline for each interleaved round, and their medians: the ratio a noisy machine shifts least.

    Two rounds next to each other share the machine's load; a pooled ratio over the whole level does not."""
    import numpy as np

    def tok_s(run: LevelRun) -> float:
        return sum(r.output_tokens or 0 for r in run.records if r.ok) / run.duration if run.duration else 0.0

    def itl_p50(run: LevelRun) -> float | None:
        gaps = [g for r in run.records if r.ok for g in r.itl]
        return float(np.median(gaps)) if gaps else None

    rounds = [(tok_s(s) / tok_s(o) if tok_s(o) else None,
               itl_p50(s) / itl_p50(o) if itl_p50(s) and itl_p50(o) else None) for s, o in zip(served, offline)]
    medians = {}
    for key, col in (("out_tok_per_s", 0), ("itl_p50", 1)):
        values = [r[col] for r in rounds if r[col] is not None]
        medians[key] = float(np.median(values)) if values else None
    return {"rounds": [{"out_tok_per_s": a, "itl_p50": b} for a, b in rounds], "median": medians}


def paired_lines(summaries: list[dict[str, Any]]) -> str:
    """One line per level: the median of the rounds' served / offline ratios."""
    lines = []
    for s in summaries:
        if s["server"] != SERVER or "paired" not in s:
            continue
        m, n = s["paired"]["median"], len(s["paired"]["rounds"])
        fmt = {k: "-" if v is None else f"{v:.2f}x" for k, v in m.items()}
        served = next((x for x in summaries if x["server"] == "pagoda" and x["level"] == s["level"]), {})
        cpu = served.get("client_cpu_ms_per_token")
        lines.append(f"concurrency {s['level']:g}: pagoda / offline, median of {n} interleaved rounds: "
                     f"out tok/s {fmt['out_tok_per_s']}, ITL p50 {fmt['itl_p50']}"
                     + (f"; the HTTP client here spent {cpu:.2f} ms CPU per token" if cpu else ""))
    return "\n".join(lines)
