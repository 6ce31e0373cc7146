"""`pagoda bench kernels`: decode bandwidth and prefill throughput of the attention backends.

Decode is bound by reading the KV cache, so it is reported as achieved bandwidth
(K and V bytes of every context read once, over the time) and as a share of
the device's measured copy bandwidth (read + write bytes of a large
torch copy). Prefill is reported in new tokens per second. On the CPU the grid
is reduced and every row also times the non-invariant SDPA variant and the
reference, so the cost of batch invariance is measured, not assumed.

On CUDA every decode point also times the invariant backend ("triton_invariant":
the prefill kernel for every step), and every prefill point torch's
`scaled_dot_product_attention` (causal, GQA) on the same K/V gathered into
contiguous tensors beforehand (the gather is not timed). `--sweep` times the
decode kernel's tile, split size and warps at a few points, for choosing them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from pagoda.core.machine import configure_threads
from pagoda.kernels import select_backend
from pagoda.kernels.kv_cache import allocate_kv_cache
from pagoda.kernels.metadata import AttentionMetadata

GPU_GRID = {"batches": [1, 16, 64], "contexts": [1024, 4096, 16384], "prefill": [512, 2048, 8192]}
# decode kernel variants `--sweep` times: (split size, tile, warps, stages); the first is the engine's
SWEEP = [(512, 32, 4, 3), (512, 64, 4, 3), (512, 64, 8, 3), (1024, 64, 4, 3), (512, 128, 8, 2), (256, 32, 4, 3),
         (1024, 128, 8, 3)]
SWEEP_POINTS = [(64, 4096), (1, 16384), (16, 4096)]
CPU_GRID = {"batches": [1, 8, 32], "contexts": [512, 2048, 8192], "prefill": [256, 1024]}
QUICK_GRID = {"batches": [1, 4], "contexts": [128], "prefill": [64]}
MAX_CACHE_BYTES = 24 << 30  # skip grid points whose K+V would exceed this


def measure_copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a large torch copy, counting the read and the write."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, reps=5)
    return 2 * nbytes / seconds


def time_call(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_case(batch, context, query_len, shape, dtype, device, gen):
    """Random q and caches, with each sequence's blocks scattered over the cache."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    per_seq = -(-context // block_size)
    k_cache, v_cache = allocate_kv_cache(batch * per_seq, block_size, num_kv_heads, head_dim, dtype, device)
    k_cache.normal_(generator=gen)
    v_cache.normal_(generator=gen)
    blocks = torch.randperm(batch * per_seq).view(batch, per_seq).tolist()
    meta = AttentionMetadata.build([query_len] * batch, [context] * batch, blocks, block_size, device)
    q = torch.randn(batch * query_len, num_heads, head_dim, dtype=dtype, device=device, generator=gen)
    return q, k_cache, v_cache, meta


def check_backends(backends: dict, shape, dtype, device, gen) -> dict[str, float]:
    """Relative error (per norm) of each backend against the reference on one mixed batch."""
    from pagoda.kernels.reference import reference_attention

    num_heads, num_kv_heads, head_dim, block_size = shape
    query_lens, seq_lens = [1, 1, 100, 40], [1100, 37, 700, 40]  # split-K decode, chunk after a prefix
    per_seq = [-(-n // block_size) for n in seq_lens]
    k_cache, v_cache = allocate_kv_cache(sum(per_seq), block_size, num_kv_heads, head_dim, dtype, device)
    k_cache.normal_(generator=gen)
    v_cache.normal_(generator=gen)
    order = torch.randperm(sum(per_seq)).tolist()
    tables = [order[sum(per_seq[:i]) : sum(per_seq[: i + 1])] for i in range(len(per_seq))]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device)
    q = torch.randn(sum(query_lens), num_heads, head_dim, dtype=dtype, device=device, generator=gen)
    ref = reference_attention(q, k_cache, v_cache, meta, head_dim**-0.5).double()
    errors = {}
    for name, backend in backends.items():
        out = backend.attention(q, k_cache, v_cache, meta, head_dim**-0.5).double()
        errors[name] = ((out - ref).norm() / ref.norm()).item()
    return errors


def run_grid(args: argparse.Namespace) -> dict:
    """Time every backend on the decode and prefill grid; returns the measurements."""
    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    shape = (args.heads, args.kv_heads, args.head_dim, args.block_size)
    names = ([args.backend, "triton_invariant"] if device.type == "cuda" and args.backend == "triton" else [args.backend]
             if device.type == "cuda" else ["cpu", "cpu_sdpa", "reference"])
    backends = {n: select_backend(device, n) for n in names}
    gen = torch.Generator(device=device).manual_seed(0)
    copy_bw = measure_copy_bandwidth(device, args.copy_mb << 20)
    scale = args.head_dim**-0.5
    result = {"device": str(device), "dtype": args.dtype, "shape": shape, "copy_gbps": copy_bw / 1e9,
              "threads": torch.get_num_threads(), "decode": [], "prefill": [],
              "check": check_backends(backends, shape, dtype, device, gen)}  # fmt: skip
    item = torch.empty((), dtype=dtype).element_size()
    for batch in args.batches:
        for context in args.contexts:
            kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * item
            if kv_bytes > MAX_CACHE_BYTES:
                continue
            case = make_case(batch, context, 1, shape, dtype, device, gen)
            row = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
            for name, backend in backends.items():
                if name == "reference" and batch * context > args.reference_limit:
                    continue
                row[name] = time_call(lambda: backend.attention(*case, scale), device, args.reps)
            decode_bw = kv_bytes / row[names[0]]
            row["gbps"], row["pct_copy"] = decode_bw / 1e9, 100 * decode_bw / copy_bw
            result["decode"].append(row)
            del case
    for tokens in args.prefill:
        case = make_case(1, tokens, tokens, shape, dtype, device, gen)
        row = {"tokens": tokens}
        for name, backend in backends.items():
            if name == "reference" and tokens > args.reference_limit // 8 or name == "triton_invariant":
                continue  # (the invariant backend's prefill is the plain one's)
            row[name] = time_call(lambda: backend.attention(*case, scale), device, args.reps)
        if device.type == "cuda":
            row["sdpa"] = time_call(sdpa_on_gathered(*case, scale), device, args.reps)
        row["tok_per_s"] = tokens / row[names[0]]
        result["prefill"].append(row)
        del case
    if args.sweep:
        result["sweep"] = sweep(shape, dtype, device, gen, args.reps, copy_bw, scale)
    return result


def sdpa_on_gathered(q, k_cache, v_cache, meta, scale) -> Callable[[], object]:
    """torch SDPA over one sequence's K/V gathered into contiguous [1, heads, T, D] tensors (the gather and the
    GQA repeat are not timed)."""
    import torch.nn.functional as F

    (n,), (table,) = meta.seq_lens_cpu, meta.block_tables
    positions = torch.arange(n, device=q.device)
    slots = table[positions // k_cache.shape[1]].long() * k_cache.shape[1] + positions % k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    # K/V heads repeated for the query heads (GQA) and made contiguous [1, H, T, D], so SDPA takes its fused path
    k = k_cache.flatten(0, 1)[slots].repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
    v = v_cache.flatten(0, 1)[slots].repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
    qq = q.transpose(0, 1).unsqueeze(0).contiguous()
    return lambda: F.scaled_dot_product_attention(qq, k, v, is_causal=True, scale=scale)


def sweep(shape, dtype, device, gen, reps: int, copy_bw: float, scale: float) -> list[dict]:
    """The decode kernel's variants (SWEEP) at SWEEP_POINTS: ms and share of the copy bandwidth."""
    from pagoda.kernels.triton_decode import decode_attention

    num_heads, num_kv_heads, head_dim, _ = shape
    item = torch.empty((), dtype=dtype).element_size()
    rows = []
    for batch, context in SWEEP_POINTS:
        q, k_cache, v_cache, meta = make_case(batch, context, 1, shape, dtype, device, gen)
        out = torch.empty_like(q)
        kv_bytes = 2 * batch * context * num_kv_heads * head_dim * item
        for split, tile, warps, stages in SWEEP:
            row = {"batch": batch, "context": context, "split": split, "tile": tile, "warps": warps, "stages": stages}
            try:
                seconds = time_call(lambda: decode_attention(q, k_cache, v_cache, meta, scale, out, split_size=split,
                                                             tile=tile, num_warps=warps, num_stages=stages),
                                    device, reps)
                row.update(ms=seconds * 1e3, pct_copy=100 * kv_bytes / seconds / copy_bw)
            except Exception as exc:  # noqa: BLE001  (a variant that does not compile is a row)
                row["error"] = f"{type(exc).__name__}: {exc}"[:160]
            rows.append(row)
        del q, k_cache, v_cache, meta, out
    return rows


def format_tables(result: dict) -> str:
    """Markdown tables of the measurements."""
    every = ("triton", "triton_invariant", "cpu", "cpu_sdpa", "reference")
    names = [n for n in every if any(n in r for r in result["decode"])]
    names = names or [n for n in every if any(n in r for r in result["prefill"])]
    main, others = names[0], names[1:]
    prefill_names = [n for n in (*names, "sdpa") if any(n in r for r in result["prefill"])]
    prefill_others = prefill_names[1:]
    lines = [
        f"device {result['device']} ({result['threads']} threads), {result['dtype']}, "
        f"heads/kv heads/head dim/block {result['shape']}, copy bandwidth {result['copy_gbps']:.1f} GB/s",
        "relative error vs reference: " + ", ".join(f"{n} {e:.1e}" for n, e in result["check"].items()),
        "",
        "| batch | context | " + " | ".join(f"{n} ms" for n in names) + " | KV GB/s | % of copy | "
        + " | ".join(f"{main}/{n}" for n in others) + " |",
        "|" + "---|" * (4 + len(names) + len(others)),
    ]
    for r in result["decode"]:
        times = " | ".join(_ms(r.get(n)) for n in names)
        ratios = " | ".join(_ratio(r.get(main), r.get(n)) for n in others)
        lines.append(f"| {r['batch']} | {r['context']} | {times} | {r['gbps']:.2f} | {r['pct_copy']:.0f}% | {ratios} |")
    lines += ["", "| prefill tokens | " + " | ".join(f"{n} tok/s" for n in prefill_names) + " | "
              + " | ".join(f"{main}/{n}" for n in prefill_others) + " |",
              "|" + "---|" * (1 + len(prefill_names) + len(prefill_others))]  # fmt: skip
    for r in result["prefill"]:
        rates = " | ".join(f"{r['tokens'] / r[n]:.0f}" if n in r else "-" for n in prefill_names)
        ratios = " | ".join(_ratio(r.get(main), r.get(n)) for n in prefill_others)
        lines.append(f"| {r['tokens']} | {rates} | {ratios} |")
    if others or prefill_others:
        lines += ["", f"{main}/X is the time ratio: above 1 means {main} is slower than X."]
    if result.get("sweep"):
        lines += ["", "| decode sweep: batch | context | split | tile | warps | stages | ms | % of copy |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in result["sweep"]:
            cells = f"{r['ms']:.3f} | {r['pct_copy']:.0f}%" if "ms" in r else f"{r['error']} | -"
            lines.append(f"| {r['batch']} | {r['context']} | {r['split']} | {r['tile']} | {r['warps']} | "
                         f"{r['stages']} | {cells} |")
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; the grid defaults to the device's (reduced on the CPU)."""
    p = argparse.ArgumentParser(prog="pagoda bench kernels", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="triton", help="backend to time on CUDA")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--contexts", type=int, nargs="+")
    p.add_argument("--prefill", type=int, nargs="+")
    p.add_argument("--quick", action="store_true", help="a tiny grid (smoke test)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--copy-mb", type=int, default=None)
    p.add_argument("--reference-limit", type=int, default=8 * 512, help="max batch*context timed for reference")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for the run")
    p.add_argument("--sweep", action="store_true", help="also time the decode kernel's variants (SWEEP)")
    p.add_argument("--json", default=None, help="also write the measurements to this file")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    grid = QUICK_GRID if args.quick else GPU_GRID if cuda else CPU_GRID
    # Llama-3.1-8B attention on a GPU (32 heads, 8 KV heads of 128); the default model's (SmolLM2-135M) on the CPU
    defaults = {"dtype": "bfloat16" if cuda else "float32", "heads": 32 if cuda else 9, "kv_heads": 8 if cuda else 3,
                "head_dim": 128 if cuda else 64,
                "reps": 3 if args.quick else 10 if cuda else 5, "copy_mb": 1024 if cuda else 256}  # fmt: skip
    for key, value in {**grid, **defaults}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the kernel benchmark and print markdown tables."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    configure_threads(args.threads or None)  # the thread count measured (a parameter of this benchmark)
    try:
        result = run_grid(args)
    finally:
        configure_threads(threads)
    print(format_tables(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
