"""Paths beyond attention and the dense model on a device: the mixture of experts, and one rank on NCCL.

    python -m pagoda.bench.gpu_extras moe [--device cuda] [--json PATH]
    python -m pagoda.bench.gpu_extras nccl --model DIR [--device cuda] [--json PATH]

`moe`: a Qwen3-MoE model of `pagoda bench moe`'s default shape (random weights) in bfloat16 through the engine:
its prefill's last logits row against the model's own dense reference forward, then decode throughput at
1, 16 and 64 prompts. `nccl`: `pagoda generate` on DIR with `--distributed-backend nccl` (gloo on the CPU; a tensor-parallel
group of one rank: the collectives' code path) against the same command without a group; greedy, so the two
texts must be equal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch


def moe(device: torch.device, dtype: torch.dtype, rows: Sequence[int], max_tokens: int) -> dict[str, Any]:
    from pagoda.bench.moe import configs
    from pagoda.bench.offline import bench_config, make_prompts
    from pagoda.core.sampling_params import SamplingParams
    from pagoda.model.architectures import build_model
    from pagoda.model.factory import make_engine

    parser = argparse.ArgumentParser()
    for name, value in (("vocab", 4096), ("hidden", 512), ("layers", 8), ("heads", 8), ("kv_heads", 2),
                        ("head_dim", 128), ("top_k", 4), ("moe_intermediate", 256), ("experts", 32)):
        parser.add_argument(f"--{name}", type=int, default=value)
    config, _ = configs(parser.parse_args([]))
    # the check against the dense reference runs in float32: in bfloat16 a near-tie in the router's top-k
    # may pick other experts in the two paths, which is rounding, not a fault of the paged path
    model = build_model(config, dtype=torch.float32, device=device, max_positions=1024)
    model.init_random_weights(seed=0, std=0.1)
    result: dict[str, Any] = {"shape": {k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers",
                                                                           "num_experts", "num_experts_per_tok")}}
    prompt = make_prompts(config.vocab_size, [100], 1, 0)[0]
    engine = make_engine(model, dataclasses.replace(bench_config(1, 200), speculative=None))
    captured: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording(batch):
        out = execute(batch)
        captured.append(out.logits[:1].float().cpu())
        return out

    engine.runner.execute = recording
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    list(engine.run())
    with torch.inference_mode():
        ref = model.reference_forward(torch.tensor(prompt, device=device))[-1].float().cpu()
    err = ((captured[0][0] - ref).norm() / ref.norm()).item()
    result["prefill_vs_reference_rel_err"] = err
    result["ok"] = err < 3e-2
    result["throughput"] = []
    model = build_model(config, dtype=dtype, device=device, max_positions=1024)
    model.init_random_weights(seed=0, std=0.1)
    for n in rows:
        engine = make_engine(model, dataclasses.replace(bench_config(n, 128 + max_tokens), speculative=None))
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        engine.add_request("warm", prompt[:64], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        list(engine.run())
        start = time.perf_counter()
        for i, ids in enumerate(make_prompts(config.vocab_size, [128], n, 1)):
            engine.add_request(str(i), ids, params)
        generated = sum(len(o.new_token_ids) for o in engine.run())
        seconds = time.perf_counter() - start
        result["throughput"].append({"prompts": n, "tokens_per_s": generated / seconds, "seconds": seconds})
        print(f"  moe, {n} prompts: {generated / seconds:.1f} tokens/s", flush=True)
    return result


def nccl(model_dir: str, device: str, max_tokens: int, timeout: float) -> dict[str, Any]:
    base = [sys.executable, "-m", "pagoda", "generate", "--model", model_dir, "--device", device, "--temperature", "0",
            "--max-tokens", str(max_tokens), "Write a haiku about the sea."]
    runs = {}
    group = "nccl" if device.startswith("cuda") else "gloo"  # gloo: the same path on a machine without a GPU
    for name, extra in (("alone", []), ("group of one", ["--distributed-backend", group])):
        start = time.perf_counter()
        proc = subprocess.run(base[:-1] + extra + base[-1:], capture_output=True, text=True, timeout=timeout)
        runs[name] = {"exit": proc.returncode, "seconds": round(time.perf_counter() - start, 2),
                      "text": proc.stdout[-400:], "stderr_tail": proc.stderr[-600:]}
        print(f"  generate, {name}: exit {proc.returncode}, {runs[name]['seconds']} s", flush=True)
    ok = all(r["exit"] == 0 for r in runs.values()) and runs["alone"]["text"] == runs["group of one"]["text"]
    return {"backend": group, "runs": runs, "ok": ok}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.gpu_extras", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("moe", "nccl"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    p.add_argument("--model", default=None, help="nccl: a Hugging Face directory")
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=150.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    if args.what == "moe":
        result = moe(torch.device(args.device), dtype, [int(n) for n in args.rows.split(",")], args.max_tokens)
    else:
        if not args.model:
            p.error("nccl needs --model DIR")
        result = nccl(args.model, args.device, args.max_tokens, args.timeout)
    print(json.dumps(result, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
