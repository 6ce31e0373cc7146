"""Interleaved A/B of n-gram speculation in the padded rows: single-stream greedy, speculation on vs off.

Usage: OMP_WAIT_POLICY=PASSIVE python benchmarks/speculative_ab.py [MAX_TOKENS] [DTYPE] [REPEATS]
(docs/performance.md, "Speculative decoding in the padded rows").

The 16 "paragraph" prompts of `pagoda bench serve` (chat template), each run alone to its end (EOS or
MAX_TOKENS) on two engines over the default model, one with the default speculation and one without, in
alternating order; per prompt: tokens / wall seconds of the whole request (prefill included). Prints the
median per-prompt ratio, the total tokens/s of each, and the acceptance rate (accepted / drafts).
"""
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagoda.bench.serve_workloads import paragraphs  # noqa: E402
from pagoda.core.engine_config import EngineConfig, SpeculativeConfig  # noqa: E402
from pagoda.core.sampling_params import SamplingParams  # noqa: E402
from pagoda.core.tokenizer import Tokenizer  # noqa: E402
from pagoda.model.factory import make_engine  # noqa: E402
from pagoda.model.hub import resolve_model  # noqa: E402
from pagoda.model.loader import load_model  # noqa: E402

max_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 128
dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 1
md = resolve_model("default", progress=False)
tok = Tokenizer.from_dir(md)
prompts = [tok.encode_chat([{"role": "user", "content": p.text}]) for p in paragraphs(max_tokens)]
max_len = max(map(len, prompts)) + max_tokens
engines = {}
for name, spec in (("on", SpeculativeConfig()), ("off", None)):
    model, cfg = load_model(md, dtype=dtype, device="cpu", max_positions=max_len)
    config = EngineConfig(num_blocks=-(-max_len // 16) + 1, block_size=16, max_running=1, max_model_len=max_len,
                          enable_prefix_caching=False, speculative=spec)
    engines[name] = make_engine(model, config, eos_token_ids=tuple(dict.fromkeys((*tok.eos_token_ids,
                                                                                 *cfg.eos_token_ids))))
params = SamplingParams(max_tokens=max_tokens, temperature=0)


def run(engine, rid, ids):
    """One request alone to its end: (tokens, seconds, steps)."""
    steps0 = engine.counters.steps_total
    start = time.perf_counter()
    engine.add_request(rid, ids, params)
    out = [t for o in engine.run() for t in o.new_token_ids]
    return out, time.perf_counter() - start, engine.counters.steps_total - steps0


for e in engines.values():  # warm up
    run(e, "warm", prompts[0][:20])
ratios, totals = [], {"on": [0, 0.0, 0], "off": [0, 0.0, 0]}
for r in range(repeats):
    for i, ids in enumerate(prompts):
        order = ("on", "off") if (i + r) % 2 == 0 else ("off", "on")
        got = {name: run(engines[name], f"{r}-{i}", ids) for name in order}
        assert got["on"][0] == got["off"][0], f"prompt {i}: speculation changed the tokens"
        for name, (toks, secs, steps) in got.items():
            totals[name][0] += len(toks)
            totals[name][1] += secs
            totals[name][2] += steps
        rate = {name: len(toks) / secs for name, (toks, secs, _) in got.items()}
        ratios.append(rate["on"] / rate["off"])
        print(f"prompt {i:2d}: {len(got['on'][0]):3d} tokens  on {rate['on']:6.1f} tok/s ({got['on'][2]} steps)"
              f"  off {rate['off']:6.1f} tok/s ({got['off'][2]} steps)  ratio {ratios[-1]:.2f}", flush=True)
s = engines["on"].stats()
drafts, accepted = s["spec_decode_draft_tokens_total"], s["spec_decode_accepted_tokens_total"]
print(f"dtype {dtype}, max_tokens {max_tokens}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
for name, (n, secs, steps) in totals.items():
    print(f"  {name:3s}: {n} tokens in {secs:.1f} s = {n / secs:.1f} tok/s, {n / steps:.2f} tokens/step")
print(f"  median per-prompt ratio on/off {statistics.median(ratios):.3f} (min {min(ratios):.2f}, max {max(ratios):.2f})")
print(f"  drafts {drafts}, accepted {accepted}: acceptance rate {accepted / max(drafts, 1):.2f}")
