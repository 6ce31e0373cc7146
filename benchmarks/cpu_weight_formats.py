"""Interleaved A/B of CPU weight formats: float32 and bfloat16-weight engines step in turn in one process.

Usage: python benchmarks/cpu_weight_formats.py ROWS[,ROWS...] [STEPS]  (docs/performance.md)
"""
import sys, time, statistics, os, gc, torch
from pagoda.model.hub import resolve_model
from pagoda.model.loader import load_model
from pagoda.bench.offline import make_prompts, bench_config, resident_bytes
from pagoda.model.factory import make_engine
from pagoda.core.sampling_params import SamplingParams
md = resolve_model("default", progress=False)
rows = [int(x) for x in sys.argv[1].split(",")]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 12
base = resident_bytes()
m32, cfg = load_model(md, dtype="float32", device="cpu", max_positions=256)
loaded = resident_bytes()
m16, _ = load_model(md, dtype="bfloat16", device="cpu", max_positions=256)
for n in rows:
    prompts = make_prompts(cfg.vocab_size, [32], n, 0)
    engines = {}
    for name, m in (("float32", m32), ("bfloat16", m16)):
        before = resident_bytes()
        e = make_engine(m, bench_config(n, 32 + 2 * steps + 8))
        if n == rows[0]:
            print(f"{name}: matmul weights {m.matmul_bytes()/1e6:.0f} MB ({m.matmul.name}); RSS change on packing {(resident_bytes()-before)/1e6:+.0f} MB", flush=True)
        p = SamplingParams(max_tokens=2 * steps + 6, temperature=0, ignore_eos=True)
        for i, ids in enumerate(prompts): e.add_request(str(i), ids, p)
        e.step(); e.step(); e.step()
        engines[name] = (e, [])
    for _ in range(steps):
        for name, (e, ts) in engines.items():
            t = time.perf_counter(); e.step(); ts.append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, (e, ts) in engines.items()}
    print(f"rows={n:3d}  float32 {med['float32']*1e3:7.1f} ms ({n/med['float32']:6.1f} tok/s)  bfloat16 {med['bfloat16']*1e3:7.1f} ms ({n/med['bfloat16']:6.1f} tok/s)  speed-up {med['float32']/med['bfloat16']:.2f}x  [OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY','-')}]", flush=True)
    del engines; gc.collect()
print(f"RSS: {base/1e6:.0f} MB before loading, {resident_bytes()/1e6:.0f} MB at the end")
