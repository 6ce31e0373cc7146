"""`pagoda bench weight-formats`: CPU weight formats side by side, one engine per format stepping in turn.

    pagoda bench weight-formats [--rows 1,16,64] [--steps N] [--formats float32,bfloat16,...]
    pagoda bench weight-formats --rss FORMAT   (resident memory of one format, in a fresh process)

Formats: the keys of FORMATS, each also as NAME-eager (the same weights with CPU step graphs off: every step
eager). Every engine decodes the same 32-token prompts at each row count, with no n-gram drafts (a step's
cost, the same work in every format); prints the median step and the speed-up over the first format, and the
resident memory each format took to load and pack.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import statistics
import time
from collections.abc import Sequence

from pagoda.bench.offline import bench_config, make_prompts, resident_bytes
from pagoda.core.machine import STATE
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.factory import make_engine
from pagoda.model.hub import resolve_model
from pagoda.model.loader import load_model, weight_format

FORMATS = {  # name: (dtype, quantization, LM head format; None = the loader's default[, the layers' kernel])
    "gguf": ("float32", "gguf", None),  # the default for the default model: its own Q4_1 layers and Q8_0 head
    "w8a8": ("float32", "w8a8", None),
    "float32": ("float32", "none", None),
    "bfloat16": ("bfloat16", "none", None),
    "int8": ("float32", "int8", "int8"),
    "int8-torch": ("float32", "int8", "int8", "int8"),
    "int8-float-head": ("float32", "int8", "float"),
    "int4": ("float32", "int4", "int8"),
    "int4-float-head": ("float32", "int4", "float"),
    "int4-int4-head": ("float32", "int4", "int4"),
}


EAGER = "-eager"  # a format's name with this suffix: its steps all eager (no CPU step graphs)


def known(name: str) -> bool:
    return name.removesuffix(EAGER) in FORMATS


def graphs(name: str) -> bool:
    """Whether a format's engine records its decode steps (CPU step graphs)."""
    return not name.endswith(EAGER)


def load(model_dir, name: str):
    dtype, quantization, head, *kernel = FORMATS[name.removesuffix(EAGER)]
    return load_model(model_dir, dtype=dtype, device="cpu", max_positions=256, quantization=quantization,
                      lm_head=head, matmul=kernel[0] if kernel else None)


def rss(model_dir, name: str) -> None:
    """One format's resident memory over the bare process (alone: freed float32 copies would blur it)."""
    base = resident_bytes()
    model, _ = load(model_dir, name)
    make_engine(model, bench_config(1, 64))
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed load buffers back, so RSS is what stays
    print(f"{name}: {weight_format(model)}, matmul weights {model.matmul_bytes() / 1e6:.0f} MB, "
          f"RSS {(resident_bytes() - base) / 1e6:.0f} MB over the bare process")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagoda bench weight-formats", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64", help="decode rows per step, comma-separated")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per row count")
    ap.add_argument("--formats", default="float32,bfloat16", help=f"comma-separated, of: {', '.join(FORMATS)}")
    ap.add_argument("--rss", metavar="FORMAT", choices=sorted(FORMATS), help="only one format's resident memory")
    args = ap.parse_args(argv)
    model_dir = resolve_model("default", progress=False)
    if args.rss:
        rss(model_dir, args.rss)
        return 0
    names = args.formats.split(",")
    unknown = [n for n in names if not known(n)]
    if unknown:
        ap.error(f"unknown format(s) {', '.join(unknown)}; known: {', '.join(FORMATS)}")
    base = resident_bytes()
    models, cfg = {}, None
    for name in names:
        before = resident_bytes()
        models[name], cfg = load(model_dir, name)
        make_engine(models[name], bench_config(1, 64, cpu_graphs=False))  # packs (and frees the plain weights) once
        gc.collect()
        print(f"{name}: {weight_format(models[name])}, matmul weights {models[name].matmul_bytes() / 1e6:.0f} MB, "
              f"RSS {(resident_bytes() - before) / 1e6:+.0f} MB loaded and packed", flush=True)
    for n in (int(x) for x in args.rows.split(",")):
        prompts = make_prompts(cfg.vocab_size, [32], n, 0)
        engines = {}
        for name, model in models.items():
            # no n-gram drafts: a step's cost, the same work in every format
            config = bench_config(n, 32 + 2 * args.steps + 8, cpu_graphs=graphs(name))
            e = make_engine(model, dataclasses.replace(config, speculative=None))
            params = SamplingParams(max_tokens=2 * args.steps + 6, temperature=0, ignore_eos=True)
            for i, ids in enumerate(prompts):
                e.add_request(str(i), ids, params)
            for _ in range(3):  # prefill and warm-up
                e.step()
            engines[name] = (e, [])
        for _ in range(args.steps):
            for name, (e, ts) in engines.items():
                t = time.perf_counter()
                e.step()
                ts.append(time.perf_counter() - t)
        med = {name: statistics.median(ts) for name, (e, ts) in engines.items()}
        first = names[0]
        cells = "  ".join(f"{name} {med[name] * 1e3:6.1f} ms ({med[first] / med[name]:.2f}x)" for name in names)
        print(f"rows={n:3d}  {cells}  [x: speed-up over {first}; OpenMP wait policy {STATE.wait_policy}]", flush=True)
        del engines
        gc.collect()
    print(f"RSS: {base / 1e6:.0f} MB before loading, {resident_bytes() / 1e6:.0f} MB at the end")
    return 0
