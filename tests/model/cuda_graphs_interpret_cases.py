"""Decode steps through DecodeGraphs' static buffers and forward (nothing captured) against eager steps, on the
Triton kernels under TRITON_INTERPRET=1: run by tests/model/test_cuda_graphs.py in a subprocess.

The forward reads only the static buffers, its decode kernel's grid sized for the longest context allowed (three
splits of 512 where the steps need one or two), padded rows in the scratch block: every row's logits and the
pool's K/V must equal the eager runner's, bitwise. Prints one line per step and per backend."""

from __future__ import annotations

import torch

from pagoda.core.engine_config import EngineConfig
from pagoda.kernels.triton_backend import TritonBackend
from pagoda.model.config import named_config
from pagoda.model.cuda_graphs import DecodeGraphs
from pagoda.model.llama import build_model
from pagoda.model.runner import StepPlan, TorchModelRunner

BLOCK, NUM_BLOCKS, MAX_LEN = 4, 560, 1100


def main() -> None:
    model = build_model(named_config("tiny"), dtype=torch.float32, device="cpu", max_positions=MAX_LEN, matmul="torch")
    model.init_random_weights(seed=0, std=0.1)
    config = EngineConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK, max_running=4, max_model_len=MAX_LEN)
    for invariant in (False, True):
        backend = TritonBackend(invariant)
        eager, other = (TorchModelRunner(model, config, backend=backend) for _ in range(2))
        graphs = DecodeGraphs(other, (1, 2, 4), MAX_LEN, scratch_block=NUM_BLOCKS - 1)
        graphs.graphs = {1: None, 2: None, 4: None}  # as if captured: can_run picks the buckets
        # the third crosses into a decode kernel's second split (the invariant backend's prefill kernel has none)
        lengths = [5, 9, 40 if invariant else 514, 3]
        seqs = [([3 + (i * 7 + j) % 90 for j in range(n)], tuple(range(i * 135, i * 135 + 135)))
                for i, n in enumerate(lengths)]
        prefill = StepPlan(lengths, lengths, [blocks[: -(-n // BLOCK)] for (_, blocks), n in zip(seqs, lengths)],
                           [t for tokens, _ in seqs for t in tokens], [1] * 4)
        with torch.inference_mode():
            assert torch.equal(eager.run(prefill), other.run(prefill))
            for rows in ([0, 1, 2, 3], [2], [1, 2], [0, 2, 3]):  # buckets 4, 1, 2 and 4 with a padded row
                for i in rows:
                    seqs[i][0].append(7 + len(seqs[i][0]) % 50)
                lens = [len(seqs[i][0]) for i in rows]
                plan = StepPlan([1] * len(rows), lens, [seqs[i][1][: -(-n // BLOCK)] for i, n in zip(rows, lens)],
                                [seqs[i][0][-1] for i in rows], [1] * len(rows))
                bucket = graphs.can_run(plan.query_lens, plan.seq_lens, plan.block_tables, plan.logits_rows)
                graphs.fill(bucket, plan.seq_lens, plan.token_ids, plan.block_tables)
                a, b = eager.run(plan), graphs.forward(bucket)[: len(rows)]
                print(f"step {backend.name} rows={len(rows)} bucket={bucket} equal={torch.equal(a, b)}", flush=True)
        last = NUM_BLOCKS - 1  # the scratch block: padded rows write it
        pool = all(torch.equal(k[:last], gk[:last]) and torch.equal(v[:last], gv[:last])
                   for (k, v), (gk, gv) in zip(eager.kv_caches, other.kv_caches))
        print(f"pool {backend.name} equal={pool}", flush=True)


if __name__ == "__main__":
    main()
