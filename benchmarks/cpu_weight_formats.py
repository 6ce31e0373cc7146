"""Interleaved A/B of CPU weight formats: one engine per format, stepping in turn in one process.

Usage: python benchmarks/cpu_weight_formats.py ROWS[,ROWS...] [STEPS] [FORMAT,FORMAT...]  (docs/performance.md)
       python benchmarks/cpu_weight_formats.py rss FORMAT  (resident memory of one format in a fresh process)
Formats: the keys of FORMATS (default: float32,bfloat16).
"""
import dataclasses
import gc
import os
import statistics
import sys
import time

from pagoda.bench.offline import bench_config, make_prompts, resident_bytes
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.factory import make_engine
from pagoda.model.hub import resolve_model
from pagoda.model.loader import load_model, weight_format

FORMATS = {  # name: (dtype, quantization, LM head format; None = the loader's default)
    "float32": ("float32", "none", None),
    "bfloat16": ("bfloat16", "none", None),
    "int8": ("float32", "int8", "int8"),
    "int8-float-head": ("float32", "int8", "float"),
    "int4": ("float32", "int4", "int8"),
    "int4-float-head": ("float32", "int4", "float"),
    "int4-int4-head": ("float32", "int4", "int4"),
}
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI sets it (read when torch starts its threads)
md = resolve_model("default", progress=False)
if sys.argv[1] == "rss":  # in one process with other formats, freed float32 copies blur the figure
    import ctypes

    base = resident_bytes()
    dtype, quantization, head = FORMATS[sys.argv[2]]
    m, _ = load_model(md, dtype=dtype, device="cpu", max_positions=256, quantization=quantization, lm_head=head)
    make_engine(m, bench_config(1, 64))
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed load buffers back, so RSS is what stays
    print(f"{sys.argv[2]}: {weight_format(m)}, matmul weights {m.matmul_bytes() / 1e6:.0f} MB, "
          f"RSS {(resident_bytes() - base) / 1e6:.0f} MB over the bare process")
    sys.exit(0)
rows = [int(x) for x in sys.argv[1].split(",")]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 12
names = sys.argv[3].split(",") if len(sys.argv) > 3 else ["float32", "bfloat16"]
base = resident_bytes()
models, cfg = {}, None
for name in names:
    dtype, quantization, head = FORMATS[name]
    before = resident_bytes()
    models[name], cfg = load_model(md, dtype=dtype, device="cpu", max_positions=256, quantization=quantization,
                                   lm_head=head)
    make_engine(models[name], bench_config(1, 64))  # packs (and frees the plain weights) once
    gc.collect()
    print(f"{name}: {weight_format(models[name])}, matmul weights {models[name].matmul_bytes() / 1e6:.0f} MB, "
          f"RSS {(resident_bytes() - before) / 1e6:+.0f} MB loaded and packed", flush=True)
for n in rows:
    prompts = make_prompts(cfg.vocab_size, [32], n, 0)
    engines = {}
    for name, m in models.items():
        # no n-gram drafts: a step's cost, the same work in every format
        e = make_engine(m, dataclasses.replace(bench_config(n, 32 + 2 * steps + 8), speculative=None))
        p = SamplingParams(max_tokens=2 * steps + 6, temperature=0, ignore_eos=True)
        for i, ids in enumerate(prompts):
            e.add_request(str(i), ids, p)
        e.step(); e.step(); e.step()  # prefill and warm-up
        engines[name] = (e, [])
    for _ in range(steps):
        for name, (e, ts) in engines.items():
            t = time.perf_counter(); e.step(); ts.append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, (e, ts) in engines.items()}
    first = names[0]
    cells = "  ".join(f"{name} {med[name] * 1e3:6.1f} ms ({med[first] / med[name]:.2f}x)" for name in names)
    print(f"rows={n:3d}  {cells}  [x: speed-up over {first}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}]",
          flush=True)
    del engines; gc.collect()
print(f"RSS: {base / 1e6:.0f} MB before loading, {resident_bytes() / 1e6:.0f} MB at the end")
