"""`pagoda bench grammar`: what constrained decoding costs, on the default model's vocabulary.

Two measurements in one run:
- mask cost: for 1, 16 and 64 constrained rows, one step's bitmask fill + apply for every row
  (`RequestGrammar.mask`, what the sampler calls), against the same rows' unconstrained greedy pick
  (argmax) as the baseline; matchers sit mid-JSON (inside a string, the widest mask, and at a key);
- engine throughput (offline): N requests through the real default model with 0%, 50% and 100% of
  them constrained (a JSON object whose one string field is long, so no request ends early), greedy,
  generated tokens per second of wall time, prefill and compiles included, as ratios to 0%.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagoda.core.machine import cpu_facts
from pagoda.core.constraint import Constraint
from pagoda.core.grammar import Grammars
from pagoda.core.sampling_params import SamplingParams

LONG_TEXT = Constraint.json_schema({"type": "object", "required": ["text"], "additionalProperties": False,
                                    "properties": {"text": {"type": "string", "minLength": 2000}}})
PERSON = Constraint.json_schema({"type": "object", "required": ["name", "age", "tags"],
                                 "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                "tags": {"type": "array", "items": {"type": "string"}}}})
STATES = {"inside a string": '{"name": "Ann', "at a key": '{"name": "Ann", '}


def mask_cost(tokenizer, vocab_size: int, rows: int, prefix: str, repeats: int) -> dict[str, float]:
    """Best ms per step of mask (fill + apply) + argmax for `rows` constrained rows, and of argmax alone.

    The best of `repeats` (each pair timed back to back): on a shared machine the minimum is the cost,
    the rest is other work.
    """
    grammars = Grammars(tokenizer.token_vocab, vocab_size, tokenizer.eos_token_ids)
    compiled = grammars.submit(PERSON).result()
    matchers = []
    for _ in range(rows):
        matcher = grammars.matcher(compiled)
        for token_id in tokenizer.encode(prefix, add_special_tokens=False):
            matcher.accept(token_id)
        matchers.append(matcher)
    logits = torch.randn(rows, vocab_size)
    masked, free = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i, matcher in enumerate(matchers):
            int(torch.argmax(matcher.mask(logits[i])))
        t1 = time.perf_counter()
        for i in range(rows):
            int(torch.argmax(logits[i]))
        t2 = time.perf_counter()
        masked.append(t1 - t0)
        free.append(t2 - t1)
    grammars.shutdown()
    return {"masked_ms": 1e3 * min(masked), "free_ms": 1e3 * min(free)}


def engine_throughput(engine, prompt: list[int], num_requests: int, fraction: float, max_tokens: int) -> float:
    """Generated tokens per second with `fraction` of `num_requests` constrained."""
    num_constrained = round(num_requests * fraction)
    t0 = time.perf_counter()
    for i in range(num_requests):
        constraint = LONG_TEXT if i < num_constrained else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, constraint=constraint)
        engine.add_request(f"{fraction}-{i}", prompt, params)
    generated = sum(len(out.new_token_ids) for out in engine.run())
    assert generated == num_requests * max_tokens, (generated, num_requests * max_tokens)
    return generated / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench grammar", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64", help="constrained rows per step for the mask cost")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--requests", type=int, default=16, help="requests per engine run")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved engine runs per fraction (best kept)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    from pagoda.model.factory import EngineOptions, build_engine

    engine, tokenizer, _ = build_engine(EngineOptions(device=args.device, dtype="float32", num_blocks=512), progress=False)
    vocab_size = engine.runner.vocab_size
    print(f"vocabulary: {tokenizer.vocab_size} tokens, {vocab_size} logits per row; torch threads {torch.get_num_threads()}")
    print()
    print("| matcher state | constrained rows | mask + argmax ms/step | argmax alone ms/step | ms per row | ratio |")
    print("|---|---|---|---|---|---|")
    for state, prefix in STATES.items():
        for rows in (int(r) for r in args.rows.split(",")):
            cost = mask_cost(tokenizer, vocab_size, rows, prefix, args.repeats)
            print(f"| {state} | {rows} | {cost['masked_ms']:.2f} | {cost['free_ms']:.2f} | "
                  f"{cost['masked_ms'] / rows:.3f} | {cost['masked_ms'] / cost['free_ms']:.1f}x |")
    print()
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Write a long JSON object about the sea."}])
    engine_throughput(engine, prompt, 2, 1.0, 4)  # warm-up: first compile, first forward
    print(f"| constrained requests | tok/s ({args.requests} requests x {args.max_tokens} tokens) | ratio to 0% |")
    print("|---|---|---|")
    fractions = (0.0, 0.5, 1.0)
    rates: dict[float, list[float]] = {f: [] for f in fractions}
    for _ in range(args.rounds):  # interleaved rounds, best of each: drift on a shared machine hits all alike
        for fraction in fractions:
            rates[fraction].append(engine_throughput(engine, prompt, args.requests, fraction, args.max_tokens))
    for fraction in fractions:
        print(f"| {fraction:.0%} | {max(rates[fraction]):.1f} | {max(rates[fraction]) / max(rates[0.0]):.2f} |")
    print(json.dumps({"compiles": engine.grammars.num_compiles, "cache_hits": engine.grammars.num_cache_hits,
                      "machine": cpu_facts().describe()}))
    engine.grammars.shutdown()
    return 0
