"""`pagoda bench moe`: a Qwen3-MoE decode step against a dense model of the same active size, same run.

    pagoda bench moe [--rows 1,16,64] [--context 128] [--rounds 5] [--steps 4] [--json FILE]
                     [--experts 32] [--top-k 4] [--hidden 512] [--moe-intermediate 256] [--layers 8] ...

Both models have random weights (nothing is read from disk) and the same attention (Qwen3's, q/k norms), the
same layers, vocabulary and kernel; the MoE model's MLPs are `--experts` experts of `--moe-intermediate`,
each token routed to `--top-k` of them, and the dense model's MLP has the intermediate size top_k x
moe_intermediate: the same active parameters a token. The default shape is Qwen3-30B-A3B scaled down to run
in seconds on a small CPU (A3B: hidden 2048, 48 layers, 32 q / 4 kv heads of 128, 128 experts of 768,
top-8, vocabulary 151936): hidden 512, 8 layers, 8 q / 2 kv heads of 128, 32 experts of 256, top-4,
vocabulary 4096 (the LM head about the same share of a token's weights as A3B's).

Each row count gets one engine per model over `rows` requests with `--context`-token prompts, prefilled
and warmed up; then `--rounds` rounds of `--steps` decode steps, the two engines stepping in turn (a shared,
noisy machine then loads both alike). Printed: the median over the rounds of each round's median step,
the range of the round medians, tokens a second, and how many experts a MoE layer ran (per step, averaged
over its layers: at 64 rows every expert runs, so the step reads every expert's weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from pagoda.core.machine import cpu_facts
from pagoda.bench.offline import bench_config, make_prompts
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.architectures import build_model
from pagoda.model.config import ModelConfig
from pagoda.model.factory import make_engine
from pagoda.model.loader import weight_format


def configs(args: argparse.Namespace) -> tuple[ModelConfig, ModelConfig]:
    """(the Qwen3-MoE config, the dense Qwen3 config of the same active size) of the command line."""
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                  rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096, qk_norm=True,
                  bos_token_id=1, eos_token_ids=(2,))
    moe = ModelConfig(**common, intermediate_size=args.top_k * args.moe_intermediate, family="qwen3_moe",
                      architecture="Qwen3MoeForCausalLM", num_experts=args.experts, num_experts_per_tok=args.top_k,
                      moe_intermediate_size=args.moe_intermediate, norm_topk_prob=True,
                      moe_layers=tuple(range(args.layers)))
    dense = ModelConfig(**common, intermediate_size=args.top_k * args.moe_intermediate, family="qwen3",
                        architecture="Qwen3ForCausalLM")
    return moe, dense


def random_model(config: ModelConfig, max_positions: int, seed: int = 0) -> Any:
    model = build_model(config, dtype=torch.float32, device="cpu", max_positions=max_positions)
    model.init_random_weights(seed=seed)
    return model


def moe_blocks(model: Any) -> list[Any]:
    return [layer.mlp for layer in model.model.layers if getattr(layer, "sparse", False)]


def experts_hit(engine: Any, model: Any) -> float:
    """One decode step, untimed: the experts a MoE layer ran, averaged over the layers."""
    hit: list[int] = []
    blocks = moe_blocks(model)

    def counting(block):
        route = block.route

        def run(*args, **kwargs):
            weights, experts = route(*args, **kwargs)
            hit.append(int(experts.unique().numel()))
            return weights, experts
        return run

    for block in blocks:
        block.route = counting(block)
    try:
        engine.step()
    finally:
        for block in blocks:
            del block.route  # the instance attribute goes; the class's method is back
    return sum(hit) / len(hit) if hit else 0.0


def decode_steps(models: dict[str, Any], rows: int, context: int, rounds: int, steps: int) -> dict[str, Any]:
    """Per model: the median of the round medians of a decode step of `rows` requests, and its spread."""
    timed = rounds * steps
    params = SamplingParams(max_tokens=timed + 8, temperature=0, ignore_eos=True)
    engines = {}
    for name, model in models.items():
        engine = make_engine(model, dataclasses.replace(bench_config(rows, context + timed + 16), speculative=None))
        for i, ids in enumerate(make_prompts(model.config.vocab_size, [context], rows, 0)):
            engine.add_request(f"{name}-{i}", ids, params)
        started: set[str] = set()
        while len(started) < rows:  # the prefill (a few steps at many rows)
            started.update(out.request_id for out in engine.step() if out.new_token_ids)
        for _ in range(2):  # warm-up
            engine.step()
        engines[name] = engine
    times: dict[str, list[list[float]]] = {name: [] for name in engines}
    for _ in range(rounds):
        round_times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(steps):
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.step()
                round_times[name].append(time.perf_counter() - start)
        for name, ts in round_times.items():
            times[name].append(ts)
    result: dict[str, Any] = {"rows": rows}
    for name, engine in engines.items():
        medians = [statistics.median(ts) for ts in times[name]]
        result[name] = {"step_s": statistics.median(medians), "round_medians_s": medians}
        if moe_blocks(models[name]):
            result[name]["experts_hit_per_layer"] = experts_hit(engine, models[name])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagoda bench moe", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64", help="decode rows per step")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of each request")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round and model")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--json", metavar="FILE", help="also write the figures to this file")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    moe_config, dense_config = configs(args)
    max_positions = args.context + args.rounds * args.steps + 32
    models = {"moe": random_model(moe_config, max_positions), "dense": random_model(dense_config, max_positions)}
    shape = (f"{args.layers} layers, hidden {args.hidden}, {args.heads} q / {args.kv_heads} kv heads of"
             f" {args.head_dim}, vocabulary {args.vocab}; MoE: {args.experts} experts of {args.moe_intermediate},"
             f" top-{args.top_k}; dense: intermediate {args.top_k * args.moe_intermediate}")
    result: dict[str, Any] = {"machine": cpu_facts().describe(), "threads": torch.get_num_threads(), "torch": torch.__version__, "context": args.context,
                              "rounds": args.rounds, "steps": args.steps, "moe_config": dataclasses.asdict(moe_config),
                              "dense_config": dataclasses.asdict(dense_config), "points": []}
    print(f"{shape}\ncontext {args.context}, {torch.get_num_threads()} threads, {args.rounds} rounds of"
          f" {args.steps} steps per model", flush=True)
    header = True
    for n in rows:
        point = decode_steps(models, n, args.context, args.rounds, args.steps)
        if header:  # the kernel is known once an engine has packed the weights
            result["weights"] = weight_format(models["moe"])
            result["matmul_bytes"] = {name: m.matmul_bytes() for name, m in models.items()}
            print(f"weights {result['weights']}: MoE {result['matmul_bytes']['moe'] / 1e6:.1f} MB, dense"
                  f" {result['matmul_bytes']['dense'] / 1e6:.1f} MB of matmul weights\n\n| rows | MoE ms | dense ms |"
                  " MoE / dense | MoE tok/s | dense tok/s | experts run / MoE layer | round medians MoE, dense ms |\n"
                  "|---:|---:|---:|---:|---:|---:|---:|---|", flush=True)
            header = False
        moe, dense = point["moe"], point["dense"]
        spread = "; ".join(f"{min(p['round_medians_s']) * 1e3:.1f}-{max(p['round_medians_s']) * 1e3:.1f}"
                           for p in (moe, dense))
        ratio = moe["step_s"] / dense["step_s"]
        print(f"| {n} | {moe['step_s'] * 1e3:.1f} | {dense['step_s'] * 1e3:.1f} | {ratio:.2f}x"
              f" | {n / moe['step_s']:.0f} | {n / dense['step_s']:.0f} | {moe['experts_hit_per_layer']:.1f} of"
              f" {args.experts} | {spread} |", flush=True)
        result["points"].append(point)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
