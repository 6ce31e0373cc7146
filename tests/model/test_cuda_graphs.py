"""CUDA graphs for decode steps: the bucket choice and the static buffers' filling (on any machine), and a tiny
model's captured decode steps against eager ones (on a CUDA GPU; skipped without)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagoda.core.engine_config import EngineConfig
from pagoda.model import cuda_graphs
from pagoda.model.config import named_config
from pagoda.model.cuda_graphs import DecodeGraphs, bucket_for, buckets_for, decode_rows
from pagoda.model.llama import build_model
from pagoda.model.runner import StepPlan, TorchModelRunner

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_step_runs_in_the_smallest_bucket_that_holds_it():
    buckets = buckets_for(64)
    assert buckets == (1, 2, 4, 8, 16, 32, 64)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 16, 17, 33, 64, 65)] == [1, 2, 4, 8, 16, 32, 64, 64, None]
    assert buckets_for(12) == (1, 2, 4, 8, 12)  # max_running's own size closes the list
    assert buckets_for(1) == (1,)
    assert buckets_for(500) == (1, 2, 4, 8, 16, 32, 64)  # more sequences than that run eagerly


def test_decode_rows_pads_with_one_token_sequences_in_the_scratch_block():
    block_size, scratch = 4, 99
    packed, tables = decode_rows(seq_lens=[6, 1, 9], token_ids=[11, 12, 13], block_tables=[(5, 7), (3,), (2, 8, 4)],
                                 bucket=4, block_size=block_size, scratch_block=scratch)
    assert packed.dtype == torch.int64 and tables.dtype == torch.int32
    ids, positions, slots, seq_lens = packed.tolist()
    assert ids == [11, 12, 13, 0]
    assert positions == [5, 0, 8, 0]  # the new token's position: seq_len - 1
    assert slots == [7 * 4 + 1, 3 * 4 + 0, 4 * 4 + 0, scratch * 4]  # block_table[p // bs] * bs + p % bs
    assert seq_lens == [6, 1, 9, 1]
    assert tables.tolist() == [[5, 7, scratch], [3, scratch, scratch], [2, 8, 4], [scratch] * 3]


def graphs_on_cpu(buckets=(1, 2, 4), max_len=32, block_size=4, scratch=50):
    """DecodeGraphs' buffers on the CPU (nothing captured: the filling and the choice only)."""
    runner = SimpleNamespace(block_size=block_size, device=torch.device("cpu"))
    graphs = DecodeGraphs(runner, buckets, max_len, scratch)
    graphs.graphs = {b: None for b in buckets}  # as if captured
    return graphs


def test_fill_writes_the_buckets_rows_and_resets_rows_a_bigger_step_left():
    graphs = graphs_on_cpu()
    assert graphs.packed.shape == (4, 4) and graphs.tables.shape == (4, 8)  # 32 tokens in blocks of 4
    graphs.fill(4, seq_lens=[5, 6, 7, 8], token_ids=[1, 2, 3, 4], block_tables=[(1, 2), (3, 4), (5, 6), (7, 8)])
    graphs.fill(4, seq_lens=[10], token_ids=[9], block_tables=[(10, 11, 12)])
    ids, positions, slots, seq_lens = graphs.packed.tolist()
    assert ids == [9, 0, 0, 0] and positions == [9, 0, 0, 0] and seq_lens == [10, 1, 1, 1]
    assert slots == [12 * 4 + 1, 200, 200, 200]  # padded rows write the scratch block (50 * 4)
    assert graphs.tables[:, :3].tolist() == [[10, 11, 12], [50, 50, 50], [50, 50, 50], [50, 50, 50]]
    assert graphs.query_start_loc.tolist() == [0, 1, 2, 3, 4]


def test_only_decode_steps_within_what_was_captured_replay():
    graphs = graphs_on_cpu()
    table = (1, 2)
    assert graphs.can_run([1, 1, 1], [5, 6, 7], [table] * 3, [1, 1, 1]) == 4
    assert graphs.can_run([1], [5], [table], [1]) == 1
    assert graphs.can_run([2, 1], [5, 6], [table] * 2, [1, 1]) is None  # a chunk of two tokens (prefill or drafts)
    assert graphs.can_run([1, 1], [5, 6], [table] * 2, [1, 0]) is None  # a row that does not sample
    assert graphs.can_run([1] * 5, [5] * 5, [table] * 5, [1] * 5) is None  # more than the largest bucket
    assert graphs.can_run([1], [33], [tuple(range(9))], [1]) is None  # past the captured context
    assert graphs.can_run([1], [8], [tuple(range(9))], [1]) is None  # a table wider than the static one


def test_on_the_cpu_the_runner_says_why_not_and_runs_eagerly():
    model = build_model(named_config("tiny"), max_positions=64)
    model.init_random_weights(seed=0, std=0.1)
    runner = TorchModelRunner(model, EngineConfig(num_blocks=16, block_size=4, cuda_graphs=True))
    assert runner.graphs is None
    assert runner.graphs_summary.startswith("off: they need a CUDA device")
    assert runner.kv_caches[0][0].shape[0] == 16  # no scratch block
    plan = StepPlan(query_lens=[3], seq_lens=[3], block_tables=[(0,)], token_ids=[5, 6, 7], logits_rows=[1])
    assert runner.run(plan).shape == (1, runner.vocab_size)
    quiet = EngineConfig(num_blocks=16, block_size=4, cpu_graphs=False)
    assert TorchModelRunner(model, quiet).graphs_summary == "off: not asked for"


# ---------------------------------------------------------------- on a CUDA GPU

BLOCK = 4


def cuda_runners(invariant: bool):
    """The same tiny model under two runners: eager, and with CUDA graphs (the invariant mode's matmul and
    attention with `invariant`)."""
    model = build_model(named_config("tiny"), dtype=torch.float32, device="cuda", max_positions=256,
                        matmul="triton_invariant" if invariant else None)
    model.init_random_weights(seed=0, std=0.1)
    config = EngineConfig(num_blocks=64, block_size=BLOCK, max_running=8, max_model_len=128, batch_invariant=invariant)
    eager = TorchModelRunner(model, config)
    graphed = TorchModelRunner(model, EngineConfig(**{**config.__dict__, "cuda_graphs": True}))
    return eager, graphed


def decode_plan(seqs, rows):
    """A decode step of the sequences at `rows`: each has its next token appended first."""
    for i in rows:
        seqs[i]["tokens"].append(7 + len(seqs[i]["tokens"]) % 50)
    lens = [len(seqs[i]["tokens"]) for i in rows]
    return StepPlan(query_lens=[1] * len(rows), seq_lens=lens,
                    block_tables=[seqs[i]["blocks"][: -(-n // BLOCK)] for i, n in zip(rows, lens)],
                    token_ids=[seqs[i]["tokens"][-1] for i in rows], logits_rows=[1] * len(rows))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("invariant", [False, True], ids=["triton", "triton_invariant"])
def test_captured_decode_steps_equal_eager_ones_bitwise(invariant):
    eager, graphed = cuda_runners(invariant)
    assert graphed.graphs is not None, graphed.graphs_summary
    assert set(graphed.graphs.graphs) == {1, 2, 4, 8}
    replays = []
    replay = graphed.graphs.replay
    graphed.graphs.replay = lambda bucket, n: replays.append((bucket, n)) or replay(bucket, n)
    lengths = [5, 9, 13, 3]
    seqs = [{"tokens": [3 + (i * 7 + j) % 90 for j in range(n)], "blocks": tuple(range(i * 16, i * 16 + 16))}
            for i, n in enumerate(lengths)]
    prefill = StepPlan(query_lens=lengths, seq_lens=lengths,
                       block_tables=[s["blocks"][: -(-n // BLOCK)] for s, n in zip(seqs, lengths)],
                       token_ids=[t for s in seqs for t in s["tokens"]], logits_rows=[1] * 4)
    torch.testing.assert_close(eager.run(prefill), graphed.run(prefill), rtol=0, atol=0)  # eager in both
    assert replays == []
    for rows in [[0, 1, 2, 3]] * 5 + [[0], [1, 2], [2], [0, 3]]:  # bucket-sized steps: the same shapes as eager
        plan = decode_plan(seqs, rows)
        a, b = eager.run(plan), graphed.run(plan)
        assert torch.equal(a, b), (rows, (a - b).abs().max())
    assert [bucket for bucket, _ in replays] == [4] * 5 + [1, 2, 1, 2]
    for (k, v), (gk, gv) in zip(eager.kv_caches, graphed.kv_caches):  # the pool's blocks, not the scratch one
        assert torch.equal(k, gk[:64]) and torch.equal(v, gv[:64])
    plan = decode_plan(seqs, [0, 1, 3])  # three rows in the bucket of four: padded
    a, b = eager.run(plan), graphed.run(plan)
    assert replays[-1] == (4, 3) and b.shape == a.shape
    if invariant:  # the invariant kernels give a row the same bits whatever the row count
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_a_capture_that_fails_leaves_the_runner_eager_and_serving(monkeypatch):
    forward = cuda_graphs.DecodeGraphs.forward

    def syncing_forward(self, bucket):  # a host sync: not allowed while a stream is captured
        out = forward(self, bucket)
        torch.cuda.synchronize()
        return out

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "forward", syncing_forward)
    eager, graphed = cuda_runners(False)
    assert graphed.graphs is None and graphed.graphs_summary.startswith("off: the capture failed")
    plan = StepPlan(query_lens=[3], seq_lens=[3], block_tables=[(0,)], token_ids=[5, 6, 7], logits_rows=[1])
    assert torch.equal(eager.run(plan), graphed.run(plan))
    plan = StepPlan(query_lens=[1], seq_lens=[4], block_tables=[(0,)], token_ids=[8], logits_rows=[1])
    assert torch.equal(eager.run(plan), graphed.run(plan))


@pytest.mark.triton_interpret
@pytest.mark.slow
def test_the_graph_forward_equals_eager_steps_on_the_triton_kernels_under_the_interpreter():
    """DecodeGraphs' buffers and forward (not captured) on the real decode kernels, under TRITON_INTERPRET=1 in a
    subprocess (the interpreter is chosen when triton decorates a kernel): every row bitwise equal to eager."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-m", "tests.model.cuda_graphs_interpret_cases"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len([line for line in lines if line.startswith("step ")]) == 8, proc.stdout
    assert all(line.endswith("equal=True") for line in lines), proc.stdout
