"""`pagoda bench crowd`: the acceptance crowd on the default model, timed.

Solo pass (each client alone, one after another) and crowd pass (all at once)
on the same live server; reports both wall times, the overlap and preemption
the crowd caused, and whether every answer matched its solo run.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from pagoda.core.machine import cpu_facts
from pagoda.harness.acceptance import check_answers, check_pool_returned, run_crowd, run_solo
from pagoda.harness.crowds import default_model_crowd
from pagoda.harness.live_server import live_server
from pagoda.model.hub import resolve_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagoda bench crowd")
    p.add_argument("--model", default="default")
    p.add_argument("--num-blocks", type=int, default=8, help="small enough that the crowd preempts")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    model_dir = resolve_model(args.model)
    with live_server(model_dir, "bench", num_blocks=args.num_blocks, block_size=16, max_running=4,
                     max_batched_tokens=256, max_model_len=2048, device=args.device, dtype=args.dtype) as live:
        async def run() -> dict:
            plans = default_model_crowd(args.max_tokens)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            solo = await run_solo(live.url, plans, live.model_name, live.endpoints)
            solo_wall = loop.time() - t0
            crowd = await run_crowd(live.url, plans, live.model_name, live.endpoints)
            await live.async_engine.wait_until_idle()
            await check_pool_returned(live.url, live.async_engine.audit)
            return {"machine": cpu_facts().describe(), "solo_wall_seconds": round(solo_wall, 2), **crowd.summary(),
                    "identical": check_answers(solo, crowd), "texts": {k: o.text for k, o in crowd.outcomes.items()}}

        result = asyncio.run(run())
    if args.json:
        print(json.dumps(result))
        return 0
    print("| solo pass s | crowd pass s | peak running | preemptions | recomputed positions | identical answers |")
    print("|---|---|---|---|---|---|")
    print(f"| {result['solo_wall_seconds']} | {result['wall_seconds']} | {result['peak_running']} | {result['preemptions']}"
          f" | {result['recomputed_tokens']} | {result['identical']}/{result['clients']} |")
    for client_id, text in result["texts"].items():
        print(f"- {client_id}: {text!r}")
    return 0
