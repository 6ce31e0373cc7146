"""`pagoda bench invariance`: what batch invariance costs on this CPU, the start-up probe's caps on and off.

    pagoda bench invariance [--dtype bfloat16,float32] [--rows 1,16,64] [--steps N] [--prefill N] [--json FILE]

Two engines over the same weights (the default model), one proving its products at start-up and capping their
calls (pagoda/model/invariance.py), one with --no-batch-invariant (every product one call, on the fastest
kernels), stepping in turn: decode steps at each row count and prefill steps of N prompts arriving together
(pagoda bench step-ab's measurements). Prints the probe's path, median ms per step and on/off; a ratio near
1 means the caps cost nothing on this machine (no kernel switch below the step's rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from pagoda.bench.offline import bench_config
from pagoda.bench.step_ab import decode, prefill
from pagoda.core.machine import cpu_facts
from pagoda.model.factory import make_engine
from pagoda.model.hub import resolve_model
from pagoda.model.loader import load_model


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagoda bench invariance", description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16,float32")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prefill", type=int, default=16, help="prompts of 10-20 tokens prefilled in one step (0: none)")
    ap.add_argument("--json", default=None, help="also write the measurements to this file")
    args = ap.parse_args(argv)
    machine = cpu_facts().describe()
    print(f"{machine['cpu']}, {machine['cores']} cores, {' '.join(machine['isa'])}; torch threads "
          f"{torch.get_num_threads()}", flush=True)
    model_dir = resolve_model("default", progress=False)
    rows = [int(r) for r in args.rows.split(",")]
    result: dict = {"machine": machine, "dtypes": {}}
    for dtype in args.dtype.split(","):
        config = bench_config(max(rows + [args.prefill]), 32 + 2 * args.steps + 8)
        engines = {}
        for on in (True, False):
            model, cfg = load_model(model_dir, dtype=dtype, device="cpu", max_positions=256)
            engines["on" if on else "off"] = make_engine(model, dataclasses.replace(config, batch_invariant=on))
        path = engines["on"].runner.invariance.summary()
        print(f"{dtype}: weights {engines['on'].runner.describe()['kernels']['matmul']}; batch invariance {path}",
              flush=True)
        entry: dict = {"path": path, "steps": {}}
        cases = [(f"decode {n} rows", lambda n=n: decode(engines, cfg.vocab_size, n, args.steps)) for n in rows]
        if args.prefill:
            cases.append((f"prefill {args.prefill} prompts",
                          lambda: prefill(engines, cfg.vocab_size, args.prefill, args.steps)))
        for label, run in cases:
            med = run()
            entry["steps"][label] = {"on_ms": med["on"] * 1e3, "off_ms": med["off"] * 1e3}
            print(f"{dtype:8s} {label:18s} on {med['on'] * 1e3:7.1f} ms  off {med['off'] * 1e3:7.1f} ms  "
                  f"on/off {med['on'] / med['off']:.2f}x", flush=True)
        result["dtypes"][dtype] = entry
        del engines
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
