"""`pagoda generate PROMPT`: offline generation on the local model, streamed to stdout."""

from __future__ import annotations

import argparse
import sys
import time

from pagoda.cli.parallel_option import add_parallel_options, parallel_fields
from pagoda.cli.speculative_option import add_speculative_option
from pagoda.core.engine_config import EngineConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt on the local model")
    p.add_argument("prompt", help="the user message (or, with --raw, the text to continue)")
    p.add_argument("--model", default="default", help="'default' (the embedded model) or a Hugging Face directory")
    p.add_argument("--raw", action="store_true", help="plain completion: do not apply the chat template")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--quantization", default="auto", choices=("auto", "none", "gguf", "w8a8", "int8", "int4"),
                   help="weight format of the linear layers on the CPU (docs/models.md): auto (the default) runs a "
                        "GGUF's own blocks (gguf) and a float checkpoint as it is (none); w8a8 rounds every weight to "
                        "Q8_0 blocks; int8/int4 are weight-only")
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="tokens per KV cache block")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not look the prompt up in the prefix cache")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="each answer's bits independent of the batch it ran in (default: on for the CPU, which "
                        "proves its kernels at start-up; off for CUDA); --no-batch-invariant: the fastest kernels")
    add_speculative_option(p)
    add_parallel_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagoda.core.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        built = _build(args, params)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagoda generate: {exc}", file=sys.stderr)
        return 2
    if isinstance(built, int):  # a torchrun rank other than 0: it worked for rank 0, and is done
        return built
    engine, tokenizer, prompt_ids = built
    from pagoda.core.batch import RunnerLost

    try:
        return _generate(engine, prompt_ids, params)
    except RunnerLost as exc:  # a tensor-parallel rank is gone
        print(f"\npagoda generate: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.close()  # a tensor-parallel group's ranks stop


def _generate(engine, prompt_ids: list[int], params) -> int:
    engine.add_request("generate", prompt_ids, params)
    start = time.perf_counter()
    first_token_at = None
    num_tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                print(f"\npagoda generate: the model step failed: {out.error}", file=sys.stderr)
                return 1
            if out.new_token_ids and first_token_at is None:
                first_token_at = time.perf_counter()
            num_tokens += len(out.new_token_ids)
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    sys.stdout.flush()  # the answer before the timing line on stderr
    _report(num_tokens, len(prompt_ids), start, first_token_at or end, end)
    return 0


def _build(args: argparse.Namespace, params):
    """Load the model and tokenizer; an Engine whose pool holds exactly this one request."""
    from pagoda.core.tokenizer import Tokenizer
    from pagoda.model.architectures import Architectures, read_config
    from pagoda.model.ranks import serve_as_worker
    from pagoda.model.factory import EngineOptions, load_engine
    from pagoda.model.hub import resolve_model
    from pagoda.model.families import register_families
    from pagoda.plugins.manager import collect_architectures, load_plugins

    architectures = Architectures(collect_architectures(register_families(load_plugins())))  # installed ones too
    model_dir = resolve_model(args.model, layouts=architectures.gguf_layouts)
    tokenizer = Tokenizer.from_dir(model_dir)
    if args.raw or not tokenizer.has_chat_template:
        if not args.raw:
            print("pagoda generate: the model has no chat template; using the prompt as plain text", file=sys.stderr)
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    total = len(prompt_ids) + params.max_tokens
    context = read_config(model_dir, architectures).max_position_embeddings
    if total > context:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                         f"context of {context} tokens")
    options = EngineOptions(model=str(model_dir), device=args.device, dtype=args.dtype, quantization=args.quantization,
                            block_size=args.block_size,
                            num_blocks=-(-total // args.block_size), max_running=1,
                            max_batched_tokens=max(EngineConfig.max_batched_tokens, args.block_size),
                            max_model_len=total, enable_prefix_caching=args.prefix_caching,
                            speculative=args.speculative, architectures=architectures,
                            batch_invariant=args.batch_invariant, **parallel_fields(args))
    status = serve_as_worker(model_dir, options)  # under torchrun, a rank other than 0
    if status is not None:
        return status
    return load_engine(model_dir, tokenizer, options), tokenizer, prompt_ids


def _report(num_tokens: int, num_prompt: int, start: float, first: float, end: float) -> None:
    decode_time = end - first
    rate = (num_tokens - 1) / decode_time if num_tokens > 1 and decode_time > 0 else float("nan")
    print(
        f"{num_tokens} tokens in {end - start:.2f} s: {rate:.1f} tokens/s decoding; "
        f"prompt {num_prompt} tokens, first token after {first - start:.2f} s",
        file=sys.stderr,
    )
