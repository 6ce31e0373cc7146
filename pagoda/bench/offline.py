"""`pagoda bench offline`: the engine against HF transformers on the same prompts, and decode against its floor.

Three measurements in one run, on the same weights and prompts:
- throughput: N prompts through the engine at once, against transformers'
  `generate` one prompt at a time and all prompts in one padded batch
  (generated tokens per second of wall time, prefill included);
- single-stream decode: one request's decode steps (prefill excluded), as
  tokens per second from the median step, against the floor: every weight
  byte read once per step at the measured copy bandwidth (read + write bytes
  of a large torch copy, as STREAM counts);
- with --compare-invariance, the same engine runs again with the plain
  (not batch-invariant) matmul and attention, so the cost is measured;
- with --tensor-parallel-size N (a model directory), the engine runs on N ranks, this process their
  rank 0, as `pagoda serve --tensor-parallel-size N` does (`pagoda bench tensor-parallel` splits a
  step into compute and communication).

Prompts are random token ids (no special tokens) and every request generates
exactly --max-tokens tokens on both sides (EOS is ignored), so the work is equal.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pagoda.core.engine import Engine
from pagoda.core.engine_config import EngineConfig
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.config import NAMED_CONFIGS, named_config
from pagoda.model.factory import EngineOptions, make_engine
from pagoda.model.ranks import sharded_model
from pagoda.model.llama import build_model


@dataclass
class Result:
    name: str
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def make_prompts(vocab_size: int, lengths: Sequence[int], num_prompts: int, seed: int, first_id: int = 17) -> list[list[int]]:
    """num_prompts random prompts cycling through `lengths`, avoiding the low (special) ids."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(first_id, vocab_size, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(num_prompts)]


def bench_config(num_prompts: int, max_len: int, *, block_size: int = EngineConfig.block_size,
                 max_batched_tokens: int = 2048) -> EngineConfig:
    """A pool that holds every prompt at full length (no preemption in a benchmark)."""
    num_blocks = num_prompts * -(-max_len // block_size) + 1
    return EngineConfig(num_blocks=num_blocks, block_size=block_size, max_running=max(num_prompts, 1),
                        max_batched_tokens=max_batched_tokens, max_model_len=max_len)


def engine_throughput(model, prompts: list[list[int]], max_tokens: int, name: str, backend=None, ranks=None) -> Result:
    """All prompts added at once, stepped until done: generated tokens / wall seconds."""
    engine = make_engine(model, bench_config(len(prompts), max(map(len, prompts)) + max_tokens), backend=backend,
                         ranks=ranks)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    _warm_up(engine, prompts[0], params)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    generated = sum(len(out.new_token_ids) for out in engine.run())
    return Result(name, generated, time.perf_counter() - start)


def single_stream_decode(model, prompt: list[int], max_tokens: int, name: str, backend=None, ranks=None) -> Result:
    """One request: decode steps only, tokens per second from the median step time."""
    engine = make_engine(model, bench_config(1, len(prompt) + max_tokens), backend=backend, ranks=ranks)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    _warm_up(engine, prompt, params)
    engine.add_request("solo", prompt, params)
    engine.step()  # the prefill
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return Result(name, 1, statistics.median(steps))


def _warm_up(engine: Engine, prompt: list[int], params: SamplingParams) -> None:
    # First calls build kernels' plans and fault in memory; keep them out of the timings.
    engine.add_request("warm-up", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for _ in engine.run():
        pass


def hf_sequential(hf_model, prompts: list[list[int]], max_tokens: int) -> Result:
    """transformers' generate, one prompt at a time."""
    hf_generate(hf_model, [prompts[0]], 2)  # warm-up
    start = time.perf_counter()
    for ids in prompts:
        hf_generate(hf_model, [ids], max_tokens)
    return Result("transformers, one at a time", len(prompts) * max_tokens, time.perf_counter() - start)


def hf_batched(hf_model, prompts: list[list[int]], max_tokens: int) -> Result:
    """transformers' generate over all prompts in one left-padded batch."""
    start = time.perf_counter()
    hf_generate(hf_model, prompts, max_tokens)
    return Result(f"transformers, padded batch of {len(prompts)}", len(prompts) * max_tokens, time.perf_counter() - start)


def hf_generate(hf_model, prompts: list[list[int]], max_tokens: int) -> torch.Tensor:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for row, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.no_grad():
        return hf_model.generate(ids.to(hf_model.device), attention_mask=mask.to(hf_model.device), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every matmul weight once in the layout it is multiplied in, and the norms."""
    norms = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "norm" in name)
    return model.matmul_bytes() + norms


def resident_bytes() -> int | None:
    """This process's resident memory (VmRSS), or None where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def render(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| measurement | tokens/s | vs |", "|---|---:|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from pagoda.model.hub import resolve_model
    from pagoda.model.loader import load_model, resolve_device, resolve_dtype
    from pagoda.model.matmul import quantized_matmul

    p = argparse.ArgumentParser(prog="pagoda bench offline", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default",
                   help=f"'default', a Hugging Face directory, or a random-weight size: {', '.join(NAMED_CONFIGS)}")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-lens", default="64", help="comma-separated prompt lengths, cycled over the prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--quantization", default="none", choices=("none", "int8", "int4", "auto"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--compare-invariance", action="store_true", help="also run the plain, not batch-invariant kernels")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="run the engine on N ranks (gloo on the CPU, NCCL on CUDA), as pagoda serve does")
    args = p.parse_args(argv)
    if args.tensor_parallel_size > 1 and (args.model in NAMED_CONFIGS or args.compare_invariance):
        p.error("--tensor-parallel-size needs a model directory (every rank loads its shard) and no "
                "--compare-invariance")

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    lengths = [int(n) for n in args.prompt_lens.split(",")]
    max_len = max(lengths) + args.max_tokens

    def load(matmul=None):
        """The model: an HF directory, or a named size with random weights (no download, no baselines)."""
        quantization = "none" if matmul else args.quantization
        if args.model in NAMED_CONFIGS:
            config = named_config(args.model)
            quantized = quantized_matmul(quantization, device)  # int8/int4 layers in a float32 model
            model = build_model(config, dtype=torch.float32 if quantized else dtype, device=device,
                                max_positions=max_len, matmul=matmul or quantized)
            model.init_random_weights(seed=args.seed)
            return model, config
        return load_model(resolve_model(args.model), dtype=dtype, device=device, max_positions=max_len, matmul=matmul,
                          quantization=quantization)

    if args.tensor_parallel_size == 1:
        model, config = load()
        return _run(args, model, config, device, dtype, load, None)
    model_dir = resolve_model(args.model)
    options = EngineOptions(model=str(model_dir), device=args.device, dtype=args.dtype, quantization=args.quantization,
                            max_model_len=max_len, tensor_parallel_size=args.tensor_parallel_size)
    with sharded_model(model_dir, options, device.type) as (model, ranks):
        return _run(args, model, model.config, device, dtype, load, ranks)


def _run(args, model, config, device, dtype, load, ranks) -> int:
    from pagoda.bench.kernels import measure_copy_bandwidth
    from pagoda.kernels import select_backend
    from pagoda.model.hub import resolve_model
    from pagoda.model.loader import weight_format

    lengths = [int(n) for n in args.prompt_lens.split(",")]
    prompts = make_prompts(config.vocab_size, lengths, args.num_prompts, args.seed)
    print(f"model {args.model}: {config.num_parameters() / 1e6:.0f}M parameters, {device}, "
          f"{str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads; {args.num_prompts} prompts of "
          f"{args.prompt_lens} tokens, {args.max_tokens} new tokens each"
          + (f"; tensor parallel {ranks.group.size} ({ranks.group.backend})" if ranks else ""), flush=True)

    ours = engine_throughput(model, prompts, args.max_tokens, f"pagoda engine, {args.num_prompts} prompts at once",
                             ranks=ranks)
    solo = single_stream_decode(model, prompts[0], args.max_tokens, "pagoda single-stream decode", ranks=ranks)
    rss = resident_bytes()  # the packed weights (plain copies freed) and two KV pools, before the copy test
    copy_bw = measure_copy_bandwidth(device, 256 << 20)
    floor_s = weight_bytes(model) / copy_bw  # under TP, rank 0's shard: each rank streams its own
    rows = [(ours.name, f"{ours.tokens_per_s:.1f}", ""),
            (solo.name, f"{solo.tokens_per_s:.1f}",
             f"{solo.tokens_per_s * floor_s:.0%} of the floor ({1 / floor_s:.1f} tokens/s: "
             f"{weight_bytes(model) / 1e6:.0f} MB per step at the copy bandwidth of {copy_bw / 1e9:.1f} GB/s; "
             f"weights streamed at {weight_bytes(model) * solo.tokens_per_s / 1e9:.1f} GB/s)")]
    if rss is not None:
        rows.append(("resident memory after both runs", "", f"{rss / 1e6:.0f} MB (matmul weights {model.matmul_bytes() / 1e6:.0f} MB, "
                     f"{weight_format(model)})"))
    if args.compare_invariance:
        plain, _ = load(matmul="torch")
        backend = select_backend(device, "cpu_sdpa") if device.type == "cpu" else None
        plain_ours = engine_throughput(plain, prompts, args.max_tokens, "engine, plain kernels", backend)
        plain_solo = single_stream_decode(plain, prompts[0], args.max_tokens, "single-stream, plain kernels", backend)
        for plain_result, invariant in ((plain_ours, ours), (plain_solo, solo)):
            ratio = invariant.tokens_per_s / plain_result.tokens_per_s
            rows.append((plain_result.name, f"{plain_result.tokens_per_s:.1f}", f"invariant is {ratio:.2f}x this"))
    if not args.no_hf and args.model not in NAMED_CONFIGS:
        rows += _hf_rows(resolve_model(args.model), dtype, device, prompts, args.max_tokens, ours)
    print(render(rows))
    return 0


def _hf_rows(model_dir: Path, dtype, device, prompts, max_tokens: int, ours: Result) -> list[tuple[str, str, str]]:
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: skipping the baselines (pip install transformers)")
        return []
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    rows = []
    for result in (hf_sequential(hf_model, prompts, max_tokens), hf_batched(hf_model, prompts, max_tokens)):
        ratio = ours.tokens_per_s / result.tokens_per_s
        rows.append((result.name, f"{result.tokens_per_s:.1f}", f"pagoda engine is {ratio:.1f}x this"))
    return rows
