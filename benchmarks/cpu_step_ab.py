"""Interleaved A/B of the CPU step: the working tree's model and attention against an earlier commit's, in one process.

Usage: python benchmarks/cpu_step_ab.py [--before REV] [--dtype float32,bfloat16] [--rows 1,16,64]
       [--steps N] [--prefill N]   (docs/performance.md, "The CPU decode step")

"before" is `pagoda/model/llama.py` and the CPU attention modules (`pagoda/kernels/`) as of REV,
loaded from git beside the current ones; both engines share the loaded weights and the matmul
kernels. Engines of the two versions step in turn: decode steps at each row count (32-token
prompts), and prefill steps of N prompts of 10-20 tokens arriving together (fresh prompts per
repetition, the same for both). Prints median ms per step and the ratio before/after.
"""
import argparse, os, statistics, subprocess, sys, time, types  # noqa: E401

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what the `pagoda` command sets
import torch  # noqa: E402

from pagoda.bench.offline import bench_config, make_prompts  # noqa: E402
from pagoda.core.sampling_params import SamplingParams  # noqa: E402
from pagoda.model.factory import make_engine  # noqa: E402
from pagoda.model.hub import resolve_model  # noqa: E402
from pagoda.model.loader import load_model  # noqa: E402

# modules of the step that the "before" version replaces, in import order (later ones import earlier ones)
MODULES = ("pagoda/kernels/workspace.py", "pagoda/kernels/kv_cache.py", "pagoda/kernels/cpu_threads.py",
           "pagoda/kernels/cpu_plan.py", "pagoda/kernels/cpu_attention.py", "pagoda/model/llama.py")


def load_before(rev: str) -> dict[str, types.ModuleType]:
    """The step's modules as of git REV, imported under 'before.*' names, importing each other."""
    mods: dict[str, types.ModuleType] = {}
    for path in MODULES:
        try:
            src = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
        except subprocess.CalledProcessError:
            continue  # not there yet at REV
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="HEAD")
    ap.add_argument("--dtype", default="bfloat16,float32")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prefill", type=int, default=16)
    args = ap.parse_args()
    before = load_before(args.before)
    model_dir = resolve_model("default", progress=False)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '-')}, load average {os.getloadavg()[0]:.2f}", flush=True)
    for dtype in args.dtype.split(","):
        engines, cfg = engines_for(model_dir, dtype, before, max(rows + [args.prefill]), 32 + 2 * args.steps + 8)
        cases = [(f"decode {n:3d} rows", lambda n=n: decode(engines, cfg.vocab_size, n, args.steps)) for n in rows]
        if args.prefill:
            cases.append((f"prefill {args.prefill} prompts", lambda: prefill(engines, cfg.vocab_size, args.prefill,
                                                                              args.steps)))
        for label, run in cases:
            med = run()
            print(f"{dtype:8s} {label:18s} before {med['before'] * 1e3:7.1f} ms  after {med['after'] * 1e3:7.1f} ms  "
                  f"before/after {med['before'] / med['after']:.2f}x  [load {os.getloadavg()[0]:.2f}]", flush=True)
        del engines


if __name__ == "__main__":
    main()
