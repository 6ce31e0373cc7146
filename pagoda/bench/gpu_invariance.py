"""Batch invariance on a device, end to end: one prompt alone against the same prompt in a crowd of 64.

    python -m pagoda.bench.gpu_invariance [--model llama-3.2-1b] [--device cuda] [--json PATH]

Two parts, each run in the default mode and in the batch-invariant one (on CUDA the Triton matmul of
kernels/triton_matmul.py and the "triton_invariant" attention; on the CPU the defaults, which are invariant):

- per op, a row alone against the same row among others (2, 8 and 64 rows): the RMSNorm, the products
  (torch's `F.linear` and the Triton one), log-softmax and argmax over the vocabulary, the embedding;
- the engine: a random-weight model of a named shape decodes one prompt alone, then the same prompt added
  with 63 others of other lengths under a small step budget (its prefill chunked, beside decodes and other
  prefills); its tokens and every sampled step's logits must be bitwise equal in the invariant mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from pagoda.bench.offline import bench_config, default_backend, invariant_kernels, make_prompts
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.config import NAMED_CONFIGS, named_config
from pagoda.model.factory import make_engine
from pagoda.model.llama import RMSNorm, build_model

TRACKED = "tracked"


def op_checks(device: torch.device, dtype: torch.dtype, hidden: int, vocab: int, seed: int = 0) -> list[dict]:
    """Each op's row 0 alone against row 0 among 2, 8 and 64 rows: bitwise equal or not."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(64, hidden, generator=gen, device=device).to(dtype)
    w = (torch.randn(hidden * 2, hidden, generator=gen, device=device) * hidden**-0.5).to(dtype)
    logits = torch.randn(64, vocab, generator=gen, device=device)
    ids = torch.randint(0, vocab, (64,), generator=gen, device=device)
    table = torch.randn(vocab, hidden, generator=gen, device=device).to(dtype)
    norm = RMSNorm(hidden, 1e-5, device=device, dtype=dtype)
    ops: dict[str, Any] = {
        "RMSNorm (torch)": lambda n: norm(x[:n]),
        "F.linear (cuBLAS on CUDA)": lambda n: F.linear(x[:n], w),
        "log_softmax over the vocabulary": lambda n: torch.log_softmax(logits[:n], dim=-1),
        "argmax over the vocabulary": lambda n: logits[:n].argmax(dim=-1),
        "embedding": lambda n: F.embedding(ids[:n], table),
    }
    if device.type == "cuda":
        from pagoda.kernels import triton_matmul

        ops["Triton matmul (invariant)"] = lambda n: triton_matmul.linear(x[:n], w)
    rows = []
    for name, op in ops.items():
        try:
            with torch.inference_mode():
                alone = op(1)[0]
                same = {n: bool(torch.equal(op(n)[0], alone)) for n in (2, 8, 64)}
            rows.append({"op": name, "equal": same, "ok": all(same.values())})
        except Exception as exc:  # noqa: BLE001  (one op's failure is a row)
            rows.append({"op": name, "error": f"{type(exc).__name__}: {exc}"[:200], "ok": False})
    return rows


def generate(model, prompts: list[list[int]], max_tokens: int, budget: int, backend) -> tuple[list[int], list]:
    """Every prompt added at once; the tracked one's (first prompt's) tokens and its sampled logits rows (CPU)."""
    max_len = max(map(len, prompts)) + max_tokens
    config = dataclasses.replace(bench_config(len(prompts), max_len, max_batched_tokens=budget), speculative=None)
    engine = make_engine(model, config, backend=backend)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rows: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording(batch):
        out = execute(batch)
        for i, chunk in enumerate(batch.sample_chunks):  # one logits row per sampling chunk (no drafts here)
            if chunk.request.request_id == TRACKED:
                rows.append(out.logits[i].float().cpu())
        return out

    engine.runner.execute = recording
    for i, ids in enumerate(prompts):
        engine.add_request(TRACKED if i == 0 else str(i), ids, params)
    tokens: list[int] = []
    for out in engine.run():
        if out.request_id == TRACKED:
            tokens += out.new_token_ids
    del engine.runner.execute
    return tokens, rows


def engine_check(model, vocab: int, backend, *, prompt_len: int, crowd: int, max_tokens: int, budget: int,
                 seed: int) -> dict:
    """The tracked prompt alone, then among `crowd - 1` others: tokens and logits compared bitwise."""
    lengths = [prompt_len, 37, 150, 401, 90, 233, 12, 300]
    prompts = make_prompts(vocab, lengths, crowd, seed)
    t0 = time.perf_counter()
    alone_tokens, alone_rows = generate(model, prompts[:1], max_tokens, budget, backend)
    crowd_tokens, crowd_rows = generate(model, prompts, max_tokens, budget, backend)
    equal_rows = sum(torch.equal(a, b) for a, b in zip(alone_rows, crowd_rows))
    diff = max(((a - b).abs().max().item() for a, b in zip(alone_rows, crowd_rows)), default=0.0)
    first = next((i for i, (a, b) in enumerate(zip(alone_tokens, crowd_tokens)) if a != b), None)
    return {"tokens_equal": alone_tokens == crowd_tokens, "first_token_difference": first,
            "logits_rows_equal": equal_rows, "logits_rows": len(alone_rows), "max_abs_logit_difference": diff,
            "ok": alone_tokens == crowd_tokens and equal_rows == len(alone_rows) == max_tokens,
            "seconds": round(time.perf_counter() - t0, 2)}


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    config = named_config(args.model)
    result: dict[str, Any] = {"model": args.model, "device": str(device), "dtype": args.dtype,
                              "ops": op_checks(device, dtype, config.hidden_size, config.vocab_size), "engine": {}}
    for row in result["ops"]:
        print(f"  op {row['op']}: {row.get('equal', row.get('error'))}", flush=True)
    matmul, backend = invariant_kernels(device, dtype)
    modes = {"default": (None, default_backend(device)), "batch-invariant": (matmul, backend)}
    if args.triton_on_cpu:  # the CUDA modes' kernels, run by Triton's interpreter (TRITON_INTERPRET=1): a smoke test
        from pagoda.kernels import select_backend, triton_matmul
        from pagoda.model.matmul import MatmulKernel

        modes = {"default": ("torch", select_backend(device, "triton")),
                 "batch-invariant": (MatmulKernel("triton_invariant", 1, triton_matmul.linear),
                                     select_backend(device, "triton_invariant"))}
    elif device.type != "cuda":  # the CPU's defaults are the invariant kernels: one mode
        modes = {"default (invariant on the CPU)": (None, None)}
    for mode, (kernel, attention) in modes.items():
        model = build_model(config, dtype=dtype, device=device, max_positions=args.prompt_len + 512 + args.max_tokens,
                            matmul=kernel)
        model.init_random_weights(seed=args.seed, std=args.std)
        try:
            check = engine_check(model, config.vocab_size, attention, prompt_len=args.prompt_len, crowd=args.crowd,
                                 max_tokens=args.max_tokens, budget=args.budget, seed=args.seed)
        except Exception as exc:  # noqa: BLE001  (the other mode still runs)
            check = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
        result["engine"][mode] = check
        print(f"  engine, {mode}: {check}", flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def table(result: dict) -> str:
    lines = [f"batch invariance on {result['device']}, {result['dtype']}, {result['model']} shape (random weights)", "",
             "| op | row 0 alone == row 0 among 2 / 8 / 64 rows |", "|---|---|"]
    for r in result["ops"]:
        cell = " / ".join("yes" if v else "**no**" for v in r["equal"].values()) if "equal" in r else r["error"]
        lines.append(f"| {r['op']} | {cell} |")
    lines += ["", "| mode | tokens equal | logits rows bitwise equal | max abs logit difference | first differing token |",
              "|---|---|---|---|---|"]
    for mode, c in result["engine"].items():
        if "error" in c:
            lines.append(f"| {mode} | error: {c['error']} | | | |")
            continue
        lines.append(f"| {mode} | {'yes' if c['tokens_equal'] else 'no'} | {c['logits_rows_equal']}/{c['logits_rows']} "
                     f"| {c['max_abs_logit_difference']:.3g} | {c['first_token_difference']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.gpu_invariance", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b", choices=list(NAMED_CONFIGS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    p.add_argument("--crowd", type=int, default=64, help="prompts in the crowd, the tracked one included")
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--budget", type=int, default=512, help="tokens a step may batch (chunks the prefills)")
    p.add_argument("--std", type=float, default=0.02, help="the random weights' standard deviation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--triton-on-cpu", action="store_true",
                   help="run the CUDA modes' Triton kernels on the CPU (needs TRITON_INTERPRET=1; tiny shapes)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    result = run(args)
    print(table(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    invariant = [c for mode, c in result["engine"].items() if mode != "default"]
    return 0 if all(c.get("ok") for c in invariant) else 1


if __name__ == "__main__":
    raise SystemExit(main())
