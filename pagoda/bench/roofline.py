"""`pagoda bench roofline`: this machine's bounds, and how close the engine's decode step comes to them.

    pagoda bench roofline [--formats gguf,gguf-eager,float32,bfloat16,int8,int4] [--rows 1,4,16,64,256] [--steps N] [--json FILE]

machine  the copy bandwidth (read + write of a 256 MiB torch copy), the read bandwidth (a sum over 256 MiB
         of touched pages), and the GEMM rate of each format's own kernel at the default model's shapes
         (its four layer products and the LM head, 256 rows), with s8 x s8 -> s32 (`torch._int_mm`, the layers,
         64 rows) beside them: what an int8-activation kernel could reach here
step     for each format and row count: the engine's median decode step (32-token contexts, no drafts)
         against its bound, max(bytes / read bandwidth, FLOPs / the format's GEMM rate): bytes are the
         matmul weights in the layout they are multiplied in plus the step's KV reads, FLOPs are
         2 x matmul weights x rows. The fraction of the bound the step reaches, and at one row the
         tokens/s and the bytes per token (a single stream's ceiling is read bandwidth / bytes per token)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from collections.abc import Sequence

import torch

from pagoda.bench.kernels import measure_copy_bandwidth, time_call
from pagoda.bench.offline import bench_config, make_prompts
from pagoda.bench.weight_formats import FORMATS, graphs, known, load
from pagoda.core.machine import STATE, cpu_facts
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.factory import make_engine
from pagoda.model.hub import resolve_model
from pagoda.model.loader import weight_format

CONTEXT = 32  # prompt tokens of every decoding request
CPU = torch.device("cpu")
GEMM_ROWS = 256


def read_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes per second of a sum over `nbytes` of touched memory (untouched pages would read as cache)."""
    x = torch.rand(nbytes // 4)
    return nbytes / time_call(lambda: x.sum(), CPU, reps=7)


def int_mm_rate(shapes: Sequence[tuple[int, int]], rows: int = 64) -> float | None:
    """s8 x s8 -> s32 operations per second over the layers' shapes (None where torch has no CPU _int_mm).

    64 rows (it wants more than 16) and the layers only: on a CPU without VNNI it runs at about 1 GOP/s."""
    total_ops, total_s = 0, 0.0
    for k, n in shapes:
        a = torch.randint(-128, 127, (rows, k), dtype=torch.int8)
        b = torch.randint(-128, 127, (k, n), dtype=torch.int8)
        try:
            total_s += time_call(lambda: torch._int_mm(a, b), CPU, reps=3)
        except RuntimeError:
            return None
        total_ops += 2 * rows * k * n
    return total_ops / total_s


def model_linears(model) -> list[tuple[str, torch.nn.Module | None, int, int]]:
    """(name, module, in, out) of the first layer's products and the LM head (module None: compute_logits)."""
    layer = model.model.layers[0]
    found = [(name, m, m.in_features, m.out_features) for name, m in (
        ("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj), ("gate_up", layer.mlp.gate_up_proj),
        ("down", layer.mlp.down_proj))]
    c = model.config
    return found + [("lm_head", None, c.hidden_size, c.vocab_size)]


def gemm_rate(model, rows: int = GEMM_ROWS) -> float:
    """FLOPs per second of the format's own products over the model's shapes at `rows` rows."""
    total_flops, total_s = 0, 0.0
    dtype = model.model.embed_tokens.weight.dtype  # the activations' (float32 around bfloat16 or int weights)
    for _, module, k, n in model_linears(model):
        x = torch.randn(rows, k, dtype=dtype)
        fn = (lambda: model.compute_logits(x)) if module is None else (lambda m=module: m(x))
        with torch.inference_mode():
            total_s += time_call(fn, CPU, reps=5)
        total_flops += 2 * rows * k * n
    return total_flops / total_s


def matmul_params(model) -> int:
    """Weights multiplied per token row: every layer's products and the LM head."""
    c = model.config
    per_layer = sum(k * n for name, _, k, n in model_linears(model) if name != "lm_head")
    return c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size


def kv_bytes(model, rows: int, context: int) -> int:
    """K and V a decode step reads: every row's context, in every layer."""
    c = model.config
    return rows * context * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4  # float32 cache


def decode_step(model, rows: int, steps: int, cpu_graphs: bool = True) -> float:
    """Median seconds of a decode step of `rows` requests (32-token prompts, no drafts)."""
    config = bench_config(rows, CONTEXT + steps + 8, cpu_graphs=cpu_graphs)
    engine = make_engine(model, dataclasses.replace(config, speculative=None))
    params = SamplingParams(max_tokens=steps + 6, temperature=0, ignore_eos=True)
    for i, ids in enumerate(make_prompts(model.config.vocab_size, [CONTEXT], rows, 0)):
        engine.add_request(str(i), ids, params)
    for _ in range(3):  # the prefill, and warm-up
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagoda bench roofline", description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="gguf,gguf-eager,float32,bfloat16,int8,int4",
                    help=f"of: {', '.join(FORMATS)} (each also as NAME-eager: no CPU step graphs)")
    ap.add_argument("--rows", default="1,4,16,64,256", help="decode rows per step")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per row count")
    ap.add_argument("--model", default="default", help="'default' (the embedded model) or its Hugging Face directory")
    ap.add_argument("--json", metavar="FILE", help="also write the figures to this file")
    args = ap.parse_args(argv)
    names, rows = args.formats.split(","), [int(r) for r in args.rows.split(",")]
    unknown = [n for n in names if not known(n)]
    if unknown:
        ap.error(f"unknown format(s) {', '.join(unknown)}; known: {', '.join(FORMATS)}")
    model_dir = resolve_model(args.model, progress=False)
    copy_bw, read_bw = measure_copy_bandwidth(CPU, 256 << 20), read_bandwidth()
    result: dict = {"machine": cpu_facts().describe(), "threads": torch.get_num_threads(), "wait_policy": STATE.wait_policy,
                    "copy_bytes_per_s": copy_bw, "read_bytes_per_s": read_bw, "formats": {}}
    machine = result["machine"]
    print(f"{machine['cpu']}, {machine['cores']} cores, {' '.join(machine['isa'])}"
          f"{', oneDNN capped at ' + machine['onednn_max_cpu_isa'] if machine['onednn_max_cpu_isa'] else ''}", flush=True)
    print(f"{torch.get_num_threads()} threads, OpenMP wait policy {STATE.wait_policy}: copy {copy_bw / 1e9:.1f} GB/s,"
          f" read {read_bw / 1e9:.1f} GB/s", flush=True)
    for name in names:
        model, _ = load(model_dir, name)
        make_engine(model, bench_config(1, 64, cpu_graphs=False))  # packs the weights as the runner does
        rate, params, wbytes = gemm_rate(model), matmul_params(model), model.matmul_bytes()
        shapes = [(k, n) for _, _, k, n in model_linears(model)]
        entry = {"weights": weight_format(model), "matmul_bytes": wbytes, "gemm_flops_per_s": rate, "steps": []}
        if name == names[0]:
            int_rate = int_mm_rate(shapes[:-1])
            result["int_mm_ops_per_s"] = int_rate
            print("s8 x s8 -> s32 (_int_mm) at the layers' shapes, 64 rows: "
                  + (f"{int_rate / 1e9:.0f} GOP/s" if int_rate else "not available"), flush=True)
        print(f"\n{name}: {entry['weights']}, {wbytes / 1e6:.0f} MB of matmul weights, GEMM {rate / 1e9:.0f} GFLOP/s"
              f" at {GEMM_ROWS} rows\n\n| rows | step ms | weights+KV / read bw ms | FLOPs / GEMM ms | bound ms |"
              " fraction of the bound | tok/s |\n|---:|---:|---:|---:|---:|---:|---:|", flush=True)
        for n in rows:
            step = decode_step(model, n, args.steps, graphs(name))
            memory = (wbytes + kv_bytes(model, n, CONTEXT + args.steps)) / read_bw
            compute = 2 * params * n / rate
            bound = max(memory, compute)
            entry["steps"].append({"rows": n, "step_s": step, "memory_s": memory, "compute_s": compute})
            print(f"| {n} | {step * 1e3:.1f} | {memory * 1e3:.1f} | {compute * 1e3:.1f} | {bound * 1e3:.1f} |"
                  f" {bound / step:.0%} | {n / step:.1f} |", flush=True)
        one = entry["steps"][0]
        if one["rows"] == 1:
            print(f"one stream: {wbytes / 1e6:.0f} MB of weights a token, a ceiling of {read_bw / wbytes:.0f} tok/s"
                  f" at the read bandwidth; the step reaches {1 / one['step_s']:.1f}", flush=True)
        result["formats"][name] = entry
        del model
        gc.collect()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
