"""`pagoda bench step-ab`: the CPU step of the working tree's model and attention against an earlier commit's.

    pagoda bench step-ab [--before REV] [--dtype float32,bfloat16] [--rows 1,16,64] [--steps N] [--prefill N]

"before" is `pagoda/model/llama.py` and the CPU attention modules (`pagoda/kernels/`) as of REV, loaded
from git beside the current ones in this process; both engines share the loaded weights and the matmul
kernels. The after engine's thread thresholds may be set (--after-small-rows, --after-small-attention: the
runner's design note, pagoda/model/runner.py). Engines of the two versions step in turn (a shared, noisy machine then loads both alike): decode
steps at each row count (32-token prompts), and prefill steps of N prompts of 10-20 tokens arriving
together (fresh prompts per repetition, the same for both). Prints median ms per step and before/after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Sequence

import torch

from pagoda.bench.offline import bench_config, make_prompts
from pagoda.core.machine import STATE
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.factory import make_engine
from pagoda.model.hub import resolve_model
from pagoda.model.loader import load_model

# modules of the step that the "before" version replaces, in import order (later ones import earlier ones);
# a module not there at REV is skipped (kernels/cpu_threads.py is there only in older revisions)
MODULES = ("pagoda/kernels/workspace.py", "pagoda/kernels/kv_cache.py", "pagoda/kernels/cpu_threads.py",
           "pagoda/kernels/cpu_plan.py", "pagoda/kernels/cpu_attention.py", "pagoda/model/llama.py")


def load_before(rev: str) -> dict[str, types.ModuleType]:
    """The step's modules as of git REV, imported under 'before.*' names, importing each other."""
    mods: dict[str, types.ModuleType] = {}
    for path in MODULES:
        try:
            src = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
        except subprocess.CalledProcessError:
            continue  # not there at REV
        for dep in MODULES:
            name = dep[:-3].replace("/", ".")
            if dep in [m.__file__ for m in mods.values()]:
                src = src.replace(f"from {name} import", f"from before.{name} import")
        mod = types.ModuleType("before." + path[:-3].replace("/", "."))
        mod.__file__ = path
        sys.modules[mod.__name__] = mod
        exec(compile(src, f"{rev}:{path}", "exec"), mod.__dict__)
        mods[path] = mod
    return mods


def engines_for(model_dir, dtype: str, before: dict, rows: int, max_len: int):
    """(name -> engine) for the current and the "before" code over the same weights."""
    model, cfg = load_model(model_dir, dtype=dtype, device="cpu", max_positions=256)
    old_llama = before["pagoda/model/llama.py"]
    old = old_llama.build_model(cfg, dtype=getattr(torch, dtype), max_positions=256, matmul=model.matmul)
    old.load_state_dict(model.state_dict())
    old_backend = before["pagoda/kernels/cpu_attention.py"].CpuBackend()
    config = bench_config(rows, max_len)
    return {"before": make_engine(old, config, backend=old_backend), "after": make_engine(model, config)}, cfg


def timed_step(engine) -> float:
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def decode(engines, vocab: int, rows: int, steps: int) -> dict[str, float]:
    """Median decode step of `rows` sequences, the engines stepping in turn."""
    params = SamplingParams(max_tokens=2 * steps + 6, temperature=0, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for name, e in engines.items():
        for i, ids in enumerate(make_prompts(vocab, [32], rows, 0)):
            e.add_request(f"d{rows}-{i}", ids, params)
        for _ in range(3):
            e.step()
    for _ in range(steps):
        for name, e in engines.items():
            times[name].append(timed_step(e))
    for e in engines.values():
        while e.has_unfinished():
            e.step()
    return {name: statistics.median(ts) for name, ts in times.items()}


def prefill(engines, vocab: int, prompts: int, reps: int) -> dict[str, float]:
    """Median step prefilling `prompts` fresh prompts of 10-20 tokens at once (one new token each)."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(reps + 1):
        batch = make_prompts(vocab, list(range(10, 21)), prompts, 1000 + rep)
        for name, e in engines.items():
            for i, ids in enumerate(batch):
                e.add_request(f"p{rep}-{i}", ids, params)
            t = timed_step(e)
            if rep:  # the first round warms up
                times[name].append(t)
            while e.has_unfinished():
                e.step()
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagoda bench step-ab", description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="HEAD", help="the git revision to compare with")
    ap.add_argument("--dtype", default="bfloat16,float32")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prefill", type=int, default=16)
    ap.add_argument("--after-small-rows", type=int, metavar="ROWS",
                    help="the after engine's runner: steps of at most ROWS rows run on one thread but for their linear"
                         " layers (default: the runner's SMALL_ROWS; 0 = never)")
    ap.add_argument("--after-small-attention", type=int, metavar="SCORES",
                    help="the after engine's runner: attention of at most SCORES score elements runs on one thread"
                         " (default: the runner's SMALL_ATTENTION; -1 = never)")
    args = ap.parse_args(argv)
    before = load_before(args.before)
    model_dir = resolve_model("default", progress=False)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch threads {torch.get_num_threads()}, OpenMP wait policy {STATE.wait_policy}, "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '-')}, load average {os.getloadavg()[0]:.2f}", flush=True)
    for dtype in args.dtype.split(","):
        engines, cfg = engines_for(model_dir, dtype, before, max(rows + [args.prefill]), 32 + 2 * args.steps + 8)
        runner = engines["after"].runner
        if args.after_small_rows is not None:
            runner.small_rows = args.after_small_rows
        if args.after_small_attention is not None:
            runner.small_attention = args.after_small_attention
        cases = [(f"decode {n:3d} rows", lambda n=n: decode(engines, cfg.vocab_size, n, args.steps)) for n in rows]
        if args.prefill:
            cases.append((f"prefill {args.prefill} prompts", lambda: prefill(engines, cfg.vocab_size, args.prefill,
                                                                              args.steps)))
        for label, run in cases:
            med = run()
            print(f"{dtype:8s} {label:18s} before {med['before'] * 1e3:7.1f} ms  after {med['after'] * 1e3:7.1f} ms  "
                  f"before/after {med['before'] / med['after']:.2f}x  [load {os.getloadavg()[0]:.2f}]", flush=True)
        del engines
    return 0
