"""Interleaved per-step cost of speculation: a step carrying n-gram drafts against a plain decode step.

Usage: OMP_WAIT_POLICY=PASSIVE python benchmarks/speculative_step_ab.py [DTYPE] [STEPS]
(docs/performance.md, "Speculative decoding in the padded rows").

The first "paragraph" prompt, greedy, on two engines over the default model (speculation on, off), stepped
alternately STEPS decode steps, three times; prints the median step time of the speculating engine's steps
with drafts, of its steps without, and of the plain engine's.
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

dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 120
md = resolve_model("default", progress=False)
ids = Tokenizer.from_dir(md).encode_chat([{"role": "user", "content": paragraphs(64)[0].text}])
engines = {}
for name, spec in (("on", SpeculativeConfig()), ("off", None)):
    model, _ = load_model(md, dtype=dtype, device="cpu", max_positions=512)
    engines[name] = make_engine(model, EngineConfig(num_blocks=40, block_size=16, max_running=1, max_model_len=512,
                                                    enable_prefix_caching=False, speculative=spec))
times = {"on, with drafts": [], "on, without": [], "off": []}
params = SamplingParams(max_tokens=3 * steps, temperature=0, ignore_eos=True)
for rep in range(3):
    for e in engines.values():
        e.add_request(str(rep), ids, params)
        e.step()  # the prefill
    for _ in range(steps):
        for name, e in engines.items():
            before = e.spec_counters.draft_tokens_total
            start = time.perf_counter()
            e.step()
            took = time.perf_counter() - start
            drafted = e.spec_counters.draft_tokens_total > before
            times["off" if name == "off" else "on, with drafts" if drafted else "on, without"].append(took)
    for e in engines.values():
        e.abort(str(rep))
        e.step()
print(f"dtype {dtype}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
for key, ts in times.items():
    if ts:
        print(f"  {key:16s} {len(ts):4d} steps, median {statistics.median(ts) * 1e3:6.1f} ms")
