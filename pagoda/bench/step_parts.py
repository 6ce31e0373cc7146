"""`pagoda bench step-parts`: where a decode step's time goes, part by part, for each weight format.

    pagoda bench step-parts [--formats int8,float32] [--rows 1,16] [--steps N]

Each part of the model (the linear layers, the LM head, attention, the KV write, the norms, the q/k split
with RoPE, the runner's input preparation) is timed by a wrapper around it during `--steps` decode steps
of 32-token contexts, no drafts; what the wrappers do not cover (embedding, residual adds, SiLU, sampling,
scheduling, Python between them) is the rest. The wrappers cost about a microsecond a call, so the
total is a little above a bare step (`pagoda bench roofline`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

from pagoda.bench.offline import bench_config, make_prompts
from pagoda.bench.weight_formats import FORMATS, load
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.factory import make_engine
from pagoda.model.hub import resolve_model
from pagoda.model.loader import weight_format

CONTEXT = 32


def _timed(totals: collections.Counter, part: str, fn: Callable) -> Callable:
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[part] += time.perf_counter() - start
    return run


def step_parts(model, rows: int, steps: int) -> tuple[float, dict[str, float]]:
    """Mean seconds of a decode step of `rows` requests, and of each part of it (the rest under 'rest')."""
    engine = make_engine(model, dataclasses.replace(bench_config(rows, CONTEXT + steps + 8), speculative=None))
    totals: collections.Counter = collections.Counter()
    backend, runner = engine.runner.backend, engine.runner
    saved = [(backend, "attention"), (backend, "write_kv"), (runner, "prepare"), (runner.model, "compute_logits")]
    for layer in model.model.layers:
        saved += [(m, "forward") for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                          layer.mlp.down_proj, layer.input_layernorm, layer.post_attention_layernorm)]
        saved.append((layer.self_attn, "_qkv"))
    names = {"attention": "attention", "write_kv": "KV write", "prepare": "prepare", "compute_logits": "LM head",
             "_qkv": "q/k split + RoPE"}
    for owner, attr in saved:
        part = names.get(attr) or ("norm" if "Norm" in type(owner).__name__ else "linear")
        setattr(owner, attr, _timed(totals, part, getattr(owner, attr)))
    try:
        params = SamplingParams(max_tokens=steps + 6, temperature=0, ignore_eos=True)
        for i, ids in enumerate(make_prompts(model.config.vocab_size, [CONTEXT], rows, 0)):
            engine.add_request(str(i), ids, params)
        for _ in range(3):  # the prefill, and warm-up
            engine.step()
        totals.clear()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = (time.perf_counter() - start) / steps
    finally:
        for owner, attr in saved:
            delattr(owner, attr)  # the instance attribute goes; the class's method is back
    parts = {part: t / steps for part, t in totals.most_common()}
    parts["rest"] = total - sum(parts.values())
    return total, parts


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagoda bench step-parts", description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="int8,float32", help=f"of: {', '.join(FORMATS)}")
    ap.add_argument("--rows", default="1,16", help="decode rows per step")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row count")
    ap.add_argument("--model", default="default", help="'default' (the embedded model) or its Hugging Face directory")
    args = ap.parse_args(argv)
    model_dir = resolve_model(args.model, progress=False)
    for name in args.formats.split(","):
        if name not in FORMATS:
            ap.error(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
        model, _ = load(model_dir, name)
        for n in (int(r) for r in args.rows.split(",")):
            total, parts = step_parts(model, n, args.steps)
            cells = ", ".join(f"{part} {t * 1e3:.1f}" for part, t in parts.items())
            print(f"{name} ({weight_format(model)}), {n} rows: step {total * 1e3:.1f} ms: {cells}", flush=True)
    return 0
