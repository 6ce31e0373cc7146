"""`pagoda bench speculative`: n-gram speculation on against off, on the default model, interleaved in one process.

    pagoda bench speculative requests [--max-tokens N] [--dtype D] [--repeats R] [--speculative-config JSON]
    pagoda bench speculative steps [--dtype D] [--steps N] [--speculative-config JSON]

requests  the 16 "paragraph" prompts of `pagoda bench serve` (chat template), each run alone to its end (EOS
          or --max-tokens) on two engines, one speculating and one not, in alternating order; per prompt
          tokens / wall seconds of the whole request (prefill included). Prints the median per-prompt ratio,
          the total tokens/s of each, and the acceptance rate (accepted / drafts). The tokens must be equal.
steps     the first paragraph prompt, greedy, on the same two engines stepped alternately: the median step of
          the speculating engine's steps with drafts, of its steps without, and of the plain engine's.

The speculating engine runs the config given (default: the engine's), and says whether its drafts can run
here (pagoda.core.speculative.in_force).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from pagoda.bench.serve.workloads import paragraphs
from pagoda.core.engine_config import EngineConfig, SpeculativeConfig
from pagoda.core.machine import STATE
from pagoda.core.sampling_params import SamplingParams
from pagoda.core.tokenizer import Tokenizer
from pagoda.model.factory import make_engine
from pagoda.model.hub import resolve_model
from pagoda.model.loader import load_model


def speculative_config(text: str) -> SpeculativeConfig | None:
    """The option's JSON (vLLM's `--speculative-config`), or argparse's error naming what is wrong."""
    try:
        return SpeculativeConfig.parse(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engines(model_dir, tok: Tokenizer, dtype: str, spec: SpeculativeConfig, max_len: int, num_blocks: int):
    """("on", "off") -> an engine over its own copy of the model, with and without speculation."""
    made = {}
    for name, config in (("on", spec), ("off", None)):
        model, cfg = load_model(model_dir, dtype=dtype, device="cpu", max_positions=max_len)
        made[name] = make_engine(model, EngineConfig(num_blocks=num_blocks, block_size=16, max_running=1,
                                                     max_model_len=max_len, enable_prefix_caching=False,
                                                     speculative=config),
                                 eos_token_ids=tuple(dict.fromkeys((*tok.eos_token_ids, *cfg.eos_token_ids))))
    print(f"dtype {dtype}, OpenMP wait policy {STATE.wait_policy}; speculative decoding"
          f" {made['on'].speculation.reason}", flush=True)
    return made


def requests(args: argparse.Namespace, model_dir, tok: Tokenizer) -> None:
    prompts = [tok.encode_chat([{"role": "user", "content": p.text}]) for p in paragraphs(args.max_tokens)]
    max_len = max(map(len, prompts)) + args.max_tokens
    made = engines(model_dir, tok, args.dtype, args.speculative, max_len, -(-max_len // 16) + 1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)

    def run(engine, rid, ids):
        """One request alone to its end: (tokens, seconds, steps)."""
        steps0 = engine.counters.steps_total
        start = time.perf_counter()
        engine.add_request(rid, ids, params)
        out = [t for o in engine.run() for t in o.new_token_ids]
        return out, time.perf_counter() - start, engine.counters.steps_total - steps0

    for e in made.values():  # warm up
        run(e, "warm", prompts[0][:20])
    ratios, totals = [], {"on": [0, 0.0, 0], "off": [0, 0.0, 0]}
    for r in range(args.repeats):
        for i, ids in enumerate(prompts):
            order = ("on", "off") if (i + r) % 2 == 0 else ("off", "on")
            got = {name: run(made[name], f"{r}-{i}", ids) for name in order}
            if got["on"][0] != got["off"][0]:
                raise RuntimeError(f"prompt {i}: speculation changed the tokens")
            for name, (toks, secs, steps) in got.items():
                totals[name][0] += len(toks)
                totals[name][1] += secs
                totals[name][2] += steps
            rate = {name: len(toks) / secs for name, (toks, secs, _) in got.items()}
            ratios.append(rate["on"] / rate["off"])
            print(f"prompt {i:2d}: {len(got['on'][0]):3d} tokens  on {rate['on']:6.1f} tok/s ({got['on'][2]} steps)"
                  f"  off {rate['off']:6.1f} tok/s ({got['off'][2]} steps)  ratio {ratios[-1]:.2f}", flush=True)
    s = made["on"].stats()
    drafts, accepted = s["spec_decode_draft_tokens_total"], s["spec_decode_accepted_tokens_total"]
    for name, (n, secs, steps) in totals.items():
        print(f"  {name:3s}: {n} tokens in {secs:.1f} s = {n / secs:.1f} tok/s, {n / steps:.2f} tokens/step")
    print(f"  median per-prompt ratio on/off {statistics.median(ratios):.3f} (min {min(ratios):.2f}, "
          f"max {max(ratios):.2f})")
    print(f"  drafts {drafts}, accepted {accepted}: acceptance rate {accepted / max(drafts, 1):.2f}")


def steps(args: argparse.Namespace, model_dir, tok: Tokenizer) -> None:
    ids = tok.encode_chat([{"role": "user", "content": paragraphs(64)[0].text}])
    made = engines(model_dir, tok, args.dtype, args.speculative, 512, 40)
    times: dict[str, list[float]] = {"on, with drafts": [], "on, without": [], "off": []}
    params = SamplingParams(max_tokens=3 * args.steps, temperature=0, ignore_eos=True)
    for rep in range(3):
        for e in made.values():
            e.add_request(str(rep), ids, params)
            e.step()  # the prefill
        for _ in range(args.steps):
            for name, e in made.items():
                before = e.spec_counters.draft_tokens_total
                start = time.perf_counter()
                e.step()
                took = time.perf_counter() - start
                drafted = e.spec_counters.draft_tokens_total > before
                times["off" if name == "off" else "on, with drafts" if drafted else "on, without"].append(took)
        for e in made.values():
            e.abort(str(rep))
            e.step()
    for key, ts in times.items():
        if ts:
            print(f"  {key:16s} {len(ts):4d} steps, median {statistics.median(ts) * 1e3:6.1f} ms")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagoda bench speculative", description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("requests", "steps"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=128, help="requests: most tokens per request")
    ap.add_argument("--repeats", type=int, default=1, help="requests: rounds over the prompts")
    ap.add_argument("--steps", type=int, default=120, help="steps: decode steps per round")
    ap.add_argument("--speculative-config", dest="speculative", type=speculative_config, default=SpeculativeConfig(),
                    metavar="JSON", help="the speculating engine's config (default: the engine's)")
    args = ap.parse_args(argv)
    if args.speculative is None:
        ap.error("--speculative-config: the speculating engine needs a config (not '{}')")
    model_dir = resolve_model("default", progress=False)
    tok = Tokenizer.from_dir(model_dir)
    (requests if args.mode == "requests" else steps)(args, model_dir, tok)
    return 0
