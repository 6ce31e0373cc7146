"""`pagoda bench serve --transformers`: Hugging Face transformers' `generate`, one prompt at a time, as a floor.

The same prompts and output length as the HTTP load, greedy, with the output length forced
(`min_new_tokens`), in this process on the model directory the pagoda serves. No server and no
streaming, so only throughput is comparable: output tokens per second of wall time.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pagoda.bench.serve.workloads import Prompt


def transformers_sequential(model_dir: str | Path, prompts: list[Prompt]) -> dict[str, Any]:
    """Generate every prompt alone with transformers, on the process's threads (pagoda.core.machine); returns
    {"server", "requests", "out_tok_per_s", ...}."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def generate(prompt: Prompt, max_tokens: int) -> int:
        ids = tokenizer(prompt.text, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, pad_token_id=tokenizer.eos_token_id or 0)
        return out.shape[1] - ids.shape[1]

    generate(prompts[0], 2)  # warm-up: first-call allocations out of the timing
    start = time.perf_counter()
    tokens = sum(generate(p, p.max_tokens) for p in prompts)
    seconds = time.perf_counter() - start
    return {"server": "transformers", "requests": len(prompts), "output_tokens": tokens, "seconds": seconds,
            "out_tok_per_s": tokens / seconds, "req_per_s": len(prompts) / seconds}


def baseline_lines(baseline: dict[str, Any], summaries: list[dict[str, Any]]) -> str:
    """Its row, and each server's output tok/s per level as a multiple of it."""
    lines = [f"transformers generate, one at a time: {baseline['requests']} requests, "
             f"{baseline['out_tok_per_s']:.2f} out tok/s ({baseline['seconds']:.1f} s)", "",
             "| level | server | out tok/s | vs transformers one at a time |", "|---|---|---|---|"]
    for s in sorted(summaries, key=lambda s: (s["level"], s["server"])):
        lines.append(f"| {s['level']:g} | {s['server']} | {s['out_tok_per_s']:.1f} | "
                     f"{s['out_tok_per_s'] / baseline['out_tok_per_s']:.2f}x |")
    return "\n".join(lines)
