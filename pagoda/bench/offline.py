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
  step into compute and communication);
- with --split, each engine run's steps are split into the forward (on the device, to its end),
  sampling and host work (scheduling, input preparation, bookkeeping): the device is synchronized at
  those boundaries only then, so the plain runs are not slowed;
- with --cuda-graphs on CUDA, decode-only steps replay CUDA graphs (pagoda/model/cuda_graphs.py); with
  --compare-cuda-graphs, each count runs without them and then with them, and the two runs' tokens and
  sampled logits rows are compared bitwise;
- with --batch-invariant on CUDA, the engine runs on the batch-invariant kernels (the Triton matmul of
  kernels/triton_matmul.py and the "triton_invariant" attention); with --compare-invariance beside it,
  the default kernels run too and the cost is their ratio.

--num-prompts takes a list (1,16,64): one engine run per count on the same model. --json writes every
measurement.

Prompts are random token ids (no special tokens) and every request generates
exactly --max-tokens tokens on both sides (EOS is ignored), so the work is equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagoda.bench.step_watch import GraphCheck, step_split
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
    split: dict[str, float] = field(default_factory=dict)  # --split: mean ms per step of each part

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def make_prompts(vocab_size: int, lengths: Sequence[int], num_prompts: int, seed: int, first_id: int = 17) -> list[list[int]]:
    """num_prompts random prompts cycling through `lengths`, avoiding the low (special) ids."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(first_id, vocab_size, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(num_prompts)]


def bench_config(num_prompts: int, max_len: int, *, block_size: int = EngineConfig.block_size,
                 max_batched_tokens: int = 2048, cuda_graphs: bool = False,
                 cpu_graphs: bool = EngineConfig.cpu_graphs) -> EngineConfig:
    """A pool that holds every prompt at full length (no preemption in a benchmark)."""
    num_blocks = num_prompts * -(-max_len // block_size) + 1
    return EngineConfig(num_blocks=num_blocks, block_size=block_size, max_running=max(num_prompts, 1),
                        max_batched_tokens=max_batched_tokens, max_model_len=max_len, cuda_graphs=cuda_graphs,
                        cpu_graphs=cpu_graphs)


def engine_throughput(model, prompts: list[list[int]], max_tokens: int, name: str, backend=None, ranks=None,
                      split: bool = False, cuda_graphs: bool = False, check: GraphCheck | None = None) -> Result:
    """All prompts added at once, stepped until done: generated tokens / wall seconds (with --split, its parts;
    with `check`, every step's logits and every request's tokens kept or compared)."""
    engine = make_engine(model, bench_config(len(prompts), max(map(len, prompts)) + max_tokens,
                                             cuda_graphs=cuda_graphs), backend=backend, ranks=ranks)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    _warm_up(engine, prompts[0], params)
    if check is not None:
        check.watch(engine)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    parts: dict[str, float] = {}
    generated = 0
    with step_split(engine, parts) if split else _nothing():
        for out in engine.run():
            generated += len(out.new_token_ids)
            if check is not None:
                check.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return Result(name, generated, time.perf_counter() - start, parts)


def single_stream_decode(model, prompt: list[int], max_tokens: int, name: str, backend=None, ranks=None,
                         split: bool = False, cuda_graphs: bool = False) -> Result:
    """One request: decode steps only, tokens per second from the median step time (with --split, its parts)."""
    engine = make_engine(model, bench_config(1, len(prompt) + max_tokens, cuda_graphs=cuda_graphs), backend=backend,
                         ranks=ranks)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    _warm_up(engine, prompt, params)
    engine.add_request("solo", prompt, params)
    engine.step()  # the prefill
    steps, parts = [], {}
    with step_split(engine, parts) if split else _nothing():
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
    return Result(name, 1, statistics.median(steps), parts)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


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


def invariant_kernels(device: torch.device, dtype: torch.dtype):
    """(matmul kernel, attention backend) of the batch-invariant mode on `device` (the CPU's defaults are)."""
    from pagoda.kernels import select_backend
    from pagoda.model import matmul

    if device.type != "cuda":
        return None, None
    return matmul.TRITON_INVARIANT, select_backend(device, batch_invariant=True)


def default_backend(device: torch.device):
    """The default mode's attention on CUDA, named ("triton"), so an engine's config cannot change it; None on the
    CPU (the runner's own choice)."""
    from pagoda.kernels import select_backend

    return select_backend(device, "triton") if device.type == "cuda" else None


def main(argv: Sequence[str] | None = None) -> int:
    from pagoda.model.hub import resolve_model
    from pagoda.model.loader import load_model, resolve_device, resolve_dtype
    from pagoda.model.matmul import quantized_matmul

    p = argparse.ArgumentParser(prog="pagoda bench offline", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default",
                   help=f"'default', a Hugging Face directory, or a random-weight size: {', '.join(NAMED_CONFIGS)}")
    p.add_argument("--num-prompts", default="16", help="prompts at once; a comma-separated list runs each count")
    p.add_argument("--prompt-lens", default="64", help="comma-separated prompt lengths, cycled over the prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--quantization", default="none", choices=("none", "int8", "int4", "gguf", "w8a8", "auto"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--compare-invariance", action="store_true",
                   help="also run the other kernels: the plain ones on the CPU, the invariant ones on CUDA "
                        "(or, with --batch-invariant, the default ones)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="on CUDA, run the batch-invariant kernels (the CPU's default kernels already are)")
    p.add_argument("--split", action="store_true", help="split each step into forward, sampling and host work")
    p.add_argument("--cuda-graphs", action="store_true", help="decode-only steps replay CUDA graphs (CUDA only)")
    p.add_argument("--compare-cuda-graphs", action="store_true",
                   help="each count without CUDA graphs, then with them: time, step split, and the tokens and "
                        "logits rows compared bitwise (the exit status is 1 if they differ)")
    p.add_argument("--no-single-stream", action="store_true", help="skip the single-stream decode run")
    p.add_argument("--json", default=None, help="also write the measurements to this file")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="run the engine on N ranks (gloo on the CPU, NCCL on CUDA), as pagoda serve does")
    args = p.parse_args(argv)
    args.num_prompts = [int(n) for n in str(args.num_prompts).split(",")]
    if args.tensor_parallel_size > 1 and (args.model in NAMED_CONFIGS or args.compare_invariance
                                          or args.batch_invariant):
        p.error("--tensor-parallel-size needs a model directory (every rank loads its shard) and no "
                "--compare-invariance or --batch-invariant")

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    lengths = [int(n) for n in args.prompt_lens.split(",")]
    max_len = max(lengths) + args.max_tokens

    def load(matmul=None):
        """The model: an HF directory, or a named size with random weights (no download, no baselines)."""
        quantization = "none" if matmul else args.quantization
        if args.model in NAMED_CONFIGS:
            config = named_config(args.model)
            # int layers in a float32 model (random weights: no GGUF blocks, so auto is none)
            quantized = quantized_matmul("none" if quantization == "auto" else quantization, device)
            model = build_model(config, dtype=torch.float32 if quantized else dtype, device=device,
                                max_positions=max_len, matmul=matmul or quantized)
            model.init_random_weights(seed=args.seed)
            return model, config
        return load_model(resolve_model(args.model), dtype=dtype, device=device, max_positions=max_len, matmul=matmul,
                          quantization=quantization)

    if args.tensor_parallel_size == 1:
        invariant_matmul, invariant_backend = invariant_kernels(device, dtype)
        if args.batch_invariant and invariant_matmul is not None:
            model, config = load(matmul=invariant_matmul)
            return _run(args, model, config, device, dtype, load, None, invariant_backend)
        model, config = load()
        return _run(args, model, config, device, dtype, load, None, default_backend(device))
    model_dir = resolve_model(args.model)
    options = EngineOptions(model=str(model_dir), device=args.device, dtype=args.dtype, quantization=args.quantization,
                            max_model_len=max_len, tensor_parallel_size=args.tensor_parallel_size)
    with sharded_model(model_dir, options, device.type) as (model, ranks):
        return _run(args, model, model.config, device, dtype, load, ranks)


def _run(args, model, config, device, dtype, load, ranks, backend=None) -> int:
    from pagoda.bench.kernels import measure_copy_bandwidth
    from pagoda.model.hub import resolve_model
    from pagoda.model.loader import weight_format

    lengths = [int(n) for n in args.prompt_lens.split(",")]
    counts = args.num_prompts
    invariant = args.batch_invariant and device.type == "cuda"
    kind = "batch-invariant kernels" if invariant else "default kernels"
    print(f"model {args.model}: {config.num_parameters() / 1e6:.0f}M parameters, {device}, "
          f"{str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, {kind}; "
          f"{','.join(map(str, counts))} prompts of {args.prompt_lens} tokens, {args.max_tokens} new tokens each"
          + (f"; tensor parallel {ranks.group.size} ({ranks.group.backend})" if ranks else ""), flush=True)

    report: dict = {"model": args.model, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                    "kernels": kind, "max_tokens": args.max_tokens, "prompt_lens": lengths, "runs": []}
    rows, results = [], {}
    graphs_ok = True
    for n in counts:
        prompts = make_prompts(config.vocab_size, lengths, n, args.seed)
        check = GraphCheck() if args.compare_cuda_graphs else None
        result = engine_throughput(model, prompts, args.max_tokens, f"pagoda engine, {n} prompts at once",
                                   backend, ranks=ranks, split=args.split,
                                   cuda_graphs=args.cuda_graphs and not args.compare_cuda_graphs, check=check)
        results[n] = result
        rows.append((result.name, f"{result.tokens_per_s:.1f}", _split_cell(result.split)))
        report["runs"].append({"num_prompts": n, **asdict(result), "tokens_per_s": result.tokens_per_s})
        print(f"  {result.name}: {result.tokens_per_s:.1f} tokens/s {_split_cell(result.split)}", flush=True)
        if check is not None:
            row, ok = _graphs_run(args, model, prompts, backend, result, check, report)
            rows.append(row)
            graphs_ok &= ok
    ours = results[counts[-1]]
    prompts = make_prompts(config.vocab_size, lengths, counts[-1], args.seed)
    copy_bw = measure_copy_bandwidth(device, 256 << 20)
    floor_s = weight_bytes(model) / copy_bw  # under TP, rank 0's shard: each rank streams its own
    report.update(copy_gbps=copy_bw / 1e9, weight_bytes=weight_bytes(model), floor_tokens_per_s=1 / floor_s)
    if not args.no_single_stream:
        solo = single_stream_decode(model, prompts[0], args.max_tokens, "pagoda single-stream decode", backend,
                                    ranks=ranks, split=args.split, cuda_graphs=args.cuda_graphs)
        report["single_stream"] = {**asdict(solo), "tokens_per_s": solo.tokens_per_s}
        rows.append((solo.name, f"{solo.tokens_per_s:.1f}",
                     f"{solo.tokens_per_s * floor_s:.0%} of the floor ({1 / floor_s:.1f} tokens/s: "
                     f"{weight_bytes(model) / 1e6:.0f} MB per step at the copy bandwidth of {copy_bw / 1e9:.1f} GB/s; "
                     f"weights streamed at {weight_bytes(model) * solo.tokens_per_s / 1e9:.1f} GB/s)"
                     + (f"; {_split_cell(solo.split)}" if solo.split else "")))
    rss = resident_bytes()  # the packed weights (plain copies freed) and the KV pools
    if rss is not None and device.type == "cpu":
        rows.append(("resident memory after the runs", "", f"{rss / 1e6:.0f} MB (matmul weights "
                     f"{model.matmul_bytes() / 1e6:.0f} MB, {weight_format(model)})"))
    if args.compare_invariance:
        rows += _compare(args, model, load, device, dtype, counts, lengths, results, report)
    if not args.no_hf and args.model not in NAMED_CONFIGS:
        rows += _hf_rows(resolve_model(args.model), dtype, device, prompts, args.max_tokens, ours)
    print(render(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if graphs_ok else 1


def _graphs_run(args, model, prompts, backend, eager: Result, kept: GraphCheck, report) -> tuple[tuple, bool]:
    """The same prompts with CUDA graphs: its row, and whether its tokens and logits equal the eager run's."""
    n = len(prompts)
    check = GraphCheck()
    result = engine_throughput(model, prompts, args.max_tokens, f"engine, {n} prompts, CUDA graphs", backend,
                               split=args.split, cuda_graphs=True, check=check)
    verdict = check.compare(kept)
    kept.logits.clear()
    check.logits.clear()
    ratio = eager.seconds / result.seconds  # above 1: graphs are faster (the eager run went first: its prefill's
    # first calls at this count's shapes are in its time, so the decode-only steps' ratio is the fairer one)
    decode = (eager.split["decode_wall_ms"] / result.split["decode_wall_ms"]
              if "decode_wall_ms" in eager.split and "decode_wall_ms" in result.split else None)
    report.setdefault("cuda_graphs", []).append({"num_prompts": n, **asdict(result),
                                                 "tokens_per_s": result.tokens_per_s, "speedup": ratio,
                                                 "decode_step_speedup": decode, **verdict})
    same = (f"tokens {'equal' if verdict['tokens_equal'] else 'DIFFER'}, logits rows bitwise equal "
            f"{verdict['logits_rows_equal']}/{verdict['logits_rows']}"
            + ("" if verdict["steps_equal"] else ", steps DIFFER")
            + (f" (max abs difference {verdict['max_abs_logit_difference']:.3g})" if not verdict["ok"] else ""))
    print(f"  {result.name}: {result.tokens_per_s:.1f} tokens/s, {ratio:.2f}x without; {same}", flush=True)
    cell = (f"{ratio:.2f}x without" + (f" (decode-only steps {decode:.2f}x)" if decode else "") + f"; {same}"
            + (f"; {_split_cell(result.split)}" if result.split else ""))
    return (result.name, f"{result.tokens_per_s:.1f}", cell), verdict["ok"]


def _compare(args, model, load, device, dtype, counts, lengths, results, report) -> list[tuple[str, str, str]]:
    """The other kernels on the same prompts: the plain ones on the CPU; on CUDA the invariant ones, or the
    default ones when this run is the invariant one. The ratio is invariant time over default time."""
    from pagoda.kernels import select_backend

    this_invariant = device.type != "cuda" or args.batch_invariant
    if device.type == "cuda" and not args.batch_invariant:
        matmul, backend = invariant_kernels(device, dtype)
        other_name = "batch-invariant kernels"
    else:
        matmul, backend = "torch", (select_backend(device, "cpu_sdpa") if device.type == "cpu" else
                                    default_backend(device))
        other_name = "plain kernels"
    del model  # the first model's weights stay referenced by the caller; only the other one is built here
    other, _ = load(matmul=matmul)
    rows, report["compare"] = [], {"other": other_name, "runs": []}
    for n in counts:
        prompts = make_prompts(other.config.vocab_size, lengths, n, args.seed)
        result = engine_throughput(other, prompts, args.max_tokens, f"engine, {n} prompts, {other_name}", backend,
                                   split=args.split)
        mine = results[n]
        # time ratio: invariant over default (above 1: invariance costs that much)
        ratio = (result.tokens_per_s / mine.tokens_per_s) if this_invariant else (mine.tokens_per_s / result.tokens_per_s)
        report["compare"]["runs"].append({"num_prompts": n, **asdict(result), "tokens_per_s": result.tokens_per_s,
                                          "invariant_time_ratio": ratio})
        rows.append((result.name, f"{result.tokens_per_s:.1f}",
                     f"invariant/default time {ratio:.2f}x" + (f"; {_split_cell(result.split)}" if result.split else "")))
        print(f"  {result.name}: {result.tokens_per_s:.1f} tokens/s, invariant/default time {ratio:.2f}x", flush=True)
    return rows


def _split_cell(split: dict[str, float]) -> str:
    if not split:
        return ""
    cell = (f"step {split['wall_ms']:.2f} ms = forward {split['forward_ms']:.2f} + sampling "
            f"{split['sampling_ms']:.2f} + host {split['host_ms']:.2f} ({split['steps']:.0f} steps)")
    if "decode_wall_ms" in split:
        cell += (f"; decode-only steps {split['decode_wall_ms']:.2f} ms = {split['decode_forward_ms']:.2f} + "
                 f"{split['decode_sampling_ms']:.2f} + {split['decode_host_ms']:.2f}")
    return cell


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
