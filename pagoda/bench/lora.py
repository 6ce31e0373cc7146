"""`pagoda bench lora`: what serving LoRA adapters costs, against the same crowd on the base model, in one run.

For each client count (1, 16, 64 by default) the same crowd runs through one engine: on the base alone, then
spread over 1, 4 and 16 adapters (request i on adapter i mod k), in rounds that alternate the variants, so that a
noisy machine slows them alike. Each client's request has the same random prompt and generates exactly
--max-tokens tokens (EOS ignored); prefix caching is off, so every variant computes the same tokens. The engine
has every adapter loaded and `--max-loras` at the most adapters measured, so a step may carry all of them.

Reported per client count and adapter count: generated tokens per second (the median over rounds) and the cost, the
base's median time over the variant's. The adapters are random PEFT directories written here (every projection,
rank --rank, alpha 2 x rank): cost does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from pagoda.core.engine import Engine
from pagoda.core.machine import cpu_facts
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.config import ModelConfig

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_random_adapter(config: ModelConfig, directory: Path, *, rank: int, seed: int, std: float = 0.02) -> Path:
    """A PEFT LoRA directory over every projection of a dense model of `config`, with random A and B."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "down_proj": (inter, h)}  # (in, out)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for block, projs in PROJECTIONS.items():
            for proj in projs:
                n_in, n_out = shapes[proj]
                key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * std
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * std
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [p for ps in PROJECTIONS.values()
                                                                                  for p in ps],
        "bias": "none", "use_rslora": False, "use_dora": False}))
    return directory


def run_crowd(engine: Engine, prompts: Sequence[list[int]], adapters: Sequence[str | None], max_tokens: int) -> float:
    """Seconds for the crowd (prompt i on adapters[i]) to finish, every request generating max_tokens tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        engine.add_request(f"r{i}", prompt, params, adapter=adapter)
    generated = sum(len(out.new_token_ids) for out in engine.run())
    seconds = time.perf_counter() - start
    assert generated == len(prompts) * max_tokens, (generated, len(prompts), max_tokens)
    return seconds


def measure(engine: Engine, names: Sequence[str], *, clients: Sequence[int], spreads: Sequence[int],
            prompt_tokens: int, max_tokens: int, rounds: int, seed: int = 0) -> list[dict[str, object]]:
    """One row per (clients, adapters) with its median seconds, tokens/s and cost against the base (spread 0)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.runner.vocab_size
    rows = []
    for n in clients:
        prompts = [torch.randint(17, vocab, (prompt_tokens,), generator=gen).tolist() for _ in range(n)]
        variants = [0, *spreads]
        times: dict[int, list[float]] = {k: [] for k in variants}
        run_crowd(engine, prompts[:1], [names[0] if spreads else None], 2)  # warm: the adapters' first products
        for _ in range(rounds):
            for k in variants:
                adapters = [None if k == 0 else names[i % k] for i in range(n)]
                times[k].append(run_crowd(engine, prompts, adapters, max_tokens))
        base = statistics.median(times[0])
        for k in variants:
            median = statistics.median(times[k])
            rows.append({"clients": n, "adapters": k, "seconds": median, "tokens_per_s": n * max_tokens / median,
                         "cost": median / base, "runs": times[k]})
    return rows


def render(rows: list[dict[str, object]]) -> str:
    lines = ["| clients | adapters | tokens/s | cost (time / base's) |", "|---|---|---|---|"]
    for r in rows:
        label = "base" if r["adapters"] == 0 else str(r["adapters"])
        lines.append(f"| {r['clients']} | {label} | {r['tokens_per_s']:.1f} | {r['cost']:.2f}x |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagoda bench lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--quantization", default="auto", help="the base's weight format (the adapters stay float32)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--clients", default="1,16,64", help="client counts, comma-separated")
    p.add_argument("--adapters", default="1,4,16", help="adapter counts the crowd is spread over, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, help="write every measurement here")
    args = p.parse_args(argv)
    from pagoda.core.machine import prepare_process
    from pagoda.model.factory import EngineOptions, build_engine

    prepare_process()
    clients = [int(x) for x in args.clients.split(",")]
    spreads = [int(x) for x in args.adapters.split(",")]
    options = EngineOptions(model=args.model, quantization=args.quantization, max_running=max(clients),
                            enable_prefix_caching=False, max_loras=max(spreads), max_lora_rank=args.rank,
                            enable_lora_loading=True,
                            max_model_len=args.prompt_tokens + args.max_tokens + 8,
                            max_batched_tokens=max(512, max(clients)))
    engine, _, _ = build_engine(options, progress=False)
    names = [f"adapter{i}" for i in range(max(spreads))]
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            engine.load_adapter(name, str(write_random_adapter(engine.runner.model_config, Path(tmp) / name,
                                                               rank=args.rank, seed=i)))
    rows = measure(engine, names, clients=clients, spreads=spreads, prompt_tokens=args.prompt_tokens,
                   max_tokens=args.max_tokens, rounds=args.rounds)
    cpu = cpu_facts()
    header = (f"{cpu.model}, {torch.get_num_threads()} threads; {args.model}, matmul "
              f"{engine.runner.describe()['kernels']['matmul']}; rank {args.rank}; {args.prompt_tokens}-token prompts, "
              f"{args.max_tokens} tokens each; median of {args.rounds} rounds")
    print(header)
    print(render(rows))
    if args.json:
        args.json.write_text(json.dumps({"setup": header, "rows": rows}, indent=1))
    return 0
