"""`pagoda bench tensor-parallel`: what a decode step at TP=N spends computing and communicating, and on paper
what TP buys where ranks have devices of their own.

    pagoda bench tensor-parallel [--sizes 1,2] [--rows 1,16,64] [--steps 8] [--json FILE]
    pagoda bench tensor-parallel --project-only

Measured: for each group size, this process is rank 0 and the other ranks are spawned, as by
`pagoda serve --tensor-parallel-size N`; each size runs decode steps of `rows` requests (32-token
prompts, no drafts) on the default model in float32. Per step: the median wall time, and from rank 0's
`TensorGroup` counters the seconds and bytes of its collectives (the all-reduces of the row-parallel
layers and the embedding, the logits gather, the plan broadcast). Compute is the rest of the step.

Projected (`project`): a decode step as weights streamed from memory plus its all-reduces on the link,
with the assumptions printed beside the figures (docs/performance/2026-12-02-tensor-parallelism.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.core.machine import cpu_facts
from pagoda.bench.offline import bench_config, make_prompts
from pagoda.distributed.group import SUM_PARTS_MIN_BYTES

CONTEXT = 32


def measure(model, ranks, rows: int, steps: int) -> dict:
    """Median step seconds of `rows` decoding requests, and rank 0's collectives per step (seconds, bytes, calls)."""
    import dataclasses

    from pagoda.core.sampling_params import SamplingParams
    from pagoda.model.factory import make_engine

    config = dataclasses.replace(bench_config(rows, CONTEXT + steps + 8), speculative=None)
    engine = make_engine(model, config, ranks=ranks)
    params = SamplingParams(max_tokens=steps + 6, temperature=0, ignore_eos=True)
    for i, ids in enumerate(make_prompts(model.config.vocab_size, [CONTEXT], rows, 0)):
        engine.add_request(str(i), ids, params)
    for _ in range(3):  # the prefill, and warm-up
        engine.step()
    stats = model.group.stats
    stats.reset()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    comm = {kind: seconds / steps for kind, seconds in stats.seconds.items()}
    return {"rows": rows, "step_s": step, "comm_s": sum(comm.values()), "comm_s_by_kind": comm,
            "comm_bytes": sum(stats.bytes.values()) / steps, "calls": sum(stats.calls.values()) / steps}


# -- on paper ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def params(self) -> int:
        d = self.hidden // self.heads
        attention = self.hidden * (self.heads + 2 * self.kv_heads) * d + self.heads * d * self.hidden
        return self.layers * (attention + 3 * self.hidden * self.intermediate) + 2 * self.vocab * self.hidden


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_s: float  # one direction, per rank
    latency_s: float  # a collective's fixed cost: per hop on a ring of machines, per collective in a switch
    per_hop: bool  # True: a ring (latency once per hop); False: one switch, every peer at once (NVSwitch)


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes_per_s: float  # what a decode step's weight stream achieves
    memory_bytes: float


SHAPES = (Shape("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128256), Shape("Llama-3.1-70B", 80, 8192, 28672, 64, 8, 128256))
# NVLink: 8 GPUs of one node behind NVSwitch, 450 GB/s a direction each, 10 us a small collective whatever the
# size (NCCL's one-shot algorithms). Ethernet: one GPU a node, 100 Gb/s (12.5 GB/s) and 10 us a hop (RoCE).
LINKS = (Link("NVLink", 450e9, 10e-6, False), Link("100 GbE", 12.5e9, 10e-6, True))
DEVICE = Device("H100 SXM 80 GB (3.35 TB/s HBM3, 80% achieved)", 0.8 * 3.35e12, 80e9)
BYTES = 2  # bfloat16 weights and activations
KV_CONTEXT = 2048  # tokens of context each row's attention reads


def project(shape: Shape, tp: int, rows: int, link: Link, device: Device = DEVICE) -> dict:
    """One decode step of `rows` rows at TP=tp, memory-bound on the weights and KV, plus its all-reduces.

    Memory: each rank streams 1/tp of the weights and of every row's KV (heads split). Communication:
    2 all-reduces a layer of rows x hidden bfloat16 values; a ring all-reduce moves 2(tp-1)/tp of the
    buffer in 2(tp-1) hops; pagoda's fixed-order one (group.py) gathers the other buffers whole at tp=2
    or below SUM_PARTS_MIN_BYTES, and otherwise runs an all-to-all and an all-gather of (tp-1)/tp of
    the buffer each: a ring's bytes and hops, in two collectives."""
    d = shape.hidden // shape.heads
    kv = rows * KV_CONTEXT * shape.layers * 2 * shape.kv_heads * d * BYTES
    memory = (shape.params * BYTES + kv) / tp / device.memory_bytes_per_s
    buffer = rows * shape.hidden * BYTES
    reduces = 2 * shape.layers

    def collective(moved: float, hops: int) -> float:
        return moved / link.bytes_per_s + (hops if link.per_hop else 1) * link.latency_s

    ring = reduces * collective(2 * (tp - 1) / tp * buffer, 2 * (tp - 1)) if tp > 1 else 0.0
    if tp == 1:
        pagoda = 0.0
    elif tp == 2 or buffer < SUM_PARTS_MIN_BYTES:  # one gather of the other ranks' buffers
        pagoda = reduces * collective((tp - 1) * buffer, tp - 1)
    else:  # an all-to-all of parts, then an all-gather of the sums (group.py)
        pagoda = reduces * 2 * collective((tp - 1) / tp * buffer, tp - 1)
    fits = shape.params * BYTES / tp < 0.9 * device.memory_bytes
    return {"shape": shape.name, "tp": tp, "rows": rows, "link": link.name, "memory_s": memory, "ring_s": ring,
            "pagoda_s": pagoda, "fits": fits}


def projection_table(rows_list: Sequence[int] = (1, 64)) -> list[dict]:
    return [project(shape, tp, rows, link) for shape in SHAPES for link in LINKS for rows in rows_list
            for tp in (1, 2, 4, 8)]


def render_projection(table: list[dict]) -> str:
    out = [f"projection: {DEVICE.name}; bfloat16; KV context {KV_CONTEXT}; step = weights+KV / tp at memory speed "
           "+ 2 all-reduces a layer", "| shape | link | rows | TP | memory ms | all-reduce ms (ring / pagoda's) | "
           "step ms | speed-up over the smallest TP that fits |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    base: dict[tuple, float] = {}
    for r in table:
        step = r["memory_s"] + r["pagoda_s"]
        key = (r["shape"], r["link"], r["rows"])
        if not r["fits"]:
            out.append(f"| {r['shape']} | {r['link']} | {r['rows']} | {r['tp']} | does not fit | | | |")
            continue
        base.setdefault(key, step)
        out.append(f"| {r['shape']} | {r['link']} | {r['rows']} | {r['tp']} | {r['memory_s'] * 1e3:.2f} | "
                   f"{r['ring_s'] * 1e3:.2f} / {r['pagoda_s'] * 1e3:.2f} | {step * 1e3:.2f} | {base[key] / step:.2f}x |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagoda bench tensor-parallel", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,2", help="tensor-parallel sizes to measure")
    ap.add_argument("--rows", default="1,16,64", help="decode rows per step")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per row count")
    ap.add_argument("--model", default="default", help="'default' (the embedded model) or a Hugging Face directory")
    ap.add_argument("--project-only", action="store_true", help="only the projection (no measurement)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures to this file")
    args = ap.parse_args(argv)
    result: dict = {"machine": cpu_facts().describe(), "projection": projection_table()}
    if not args.project_only:
        result["measured"] = run_measurements(args)
    print(render_projection(result["projection"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def run_measurements(args: argparse.Namespace) -> dict:
    import dataclasses

    import torch

    from pagoda.model.factory import EngineOptions
    from pagoda.model.hub import resolve_model
    from pagoda.model.loader import load_shard
    from pagoda.model.ranks import sharded_model

    model_dir = resolve_model(args.model, progress=False)
    rows_list = [int(r) for r in args.rows.split(",")]
    options = EngineOptions(model=str(model_dir), device="cpu", dtype="float32", max_model_len=CONTEXT + args.steps + 16)
    measured: dict = {"threads": torch.get_num_threads(), "sizes": {}}
    print(f"{torch.get_num_threads()} threads in all; float32; {CONTEXT}-token prompts; median of {args.steps} steps")
    print("| TP | rows | step ms | collectives ms (share) | of which all-reduce / gather / broadcast ms | "
          "bytes sent a step | collectives a step |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        if size == 1:
            model = load_shard(model_dir, options)
            runs = [measure(model, None, rows, args.steps) for rows in rows_list]
        else:
            with sharded_model(model_dir, dataclasses.replace(options, tensor_parallel_size=size)) as (model, ranks):
                runs = [measure(model, ranks, rows, args.steps) for rows in rows_list]
        measured["sizes"][size] = runs
        for r in runs:
            kinds = r["comm_s_by_kind"]
            parts = " / ".join(f"{kinds.get(k, 0) * 1e3:.1f}" for k in ("all_reduce", "gather", "broadcast"))
            print(f"| {size} | {r['rows']} | {r['step_s'] * 1e3:.1f} | {r['comm_s'] * 1e3:.1f} "
                  f"({r['comm_s'] / r['step_s']:.0%}) | {parts} | {r['comm_bytes'] / 1e6:.2f} MB | {r['calls']:.0f} |",
                  flush=True)
    return measured
