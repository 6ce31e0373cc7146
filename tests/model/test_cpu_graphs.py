"""CPU step graphs: a decode step recorded once per bucket and replayed in one native call gives every row the
bits of the eager step, on every format whose products are pagoda's kernels, at every row count and thread
count; a step with an op the replay does not know runs eagerly and the runner says which op."""

from __future__ import annotations

import pytest
import torch

from pagoda.core.engine_config import EngineConfig
from pagoda.kernels import cpu_native
from pagoda.model import cpu_graphs
from pagoda.model.config import named_config
from pagoda.model.llama import build_model
from pagoda.model.matmul import BLOCKS, INT8_AVX2
from pagoda.model.runner import StepPlan, TorchModelRunner
from tests.model.test_cuda_graphs import BLOCK, decode_plan

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"{cpu_native.load()}")

def runners(matmul, *, max_running=8, config_name="tiny"):
    """The same model under two runners: eager, and with CPU step graphs."""
    model = build_model(named_config(config_name), max_positions=256, matmul=matmul)
    model.init_random_weights(seed=0, std=0.1)  # quantized at packing, the LM head too
    config = EngineConfig(num_blocks=64, block_size=BLOCK, max_running=max_running, max_model_len=128,
                          cpu_graphs=False)
    eager = TorchModelRunner(model, config)
    graphed = TorchModelRunner(model, EngineConfig(**{**config.__dict__, "cpu_graphs": True}))
    return eager, graphed


def counting(graphed):
    replays = []
    replay = graphed.graphs.replay
    graphed.graphs.replay = lambda bucket, n: replays.append((bucket, n)) or replay(bucket, n)
    return replays


@pytest.mark.parametrize("matmul", [BLOCKS, INT8_AVX2], ids=lambda k: k.name)
def test_replayed_decode_steps_equal_eager_ones_bitwise_at_every_row_count(matmul):
    eager, graphed = runners(matmul)
    assert graphed.graphs is not None, graphed.graphs_summary
    assert graphed.graphs_summary.startswith("on: ")
    assert set(graphed.graphs.programs) == {1, 2, 3, 4, 6, 8}
    assert eager.graphs is None and eager.graphs_summary == "off: not asked for"
    replays = counting(graphed)
    lengths = [5, 9, 13, 3, 7, 2, 11, 4]
    seqs = [{"tokens": [3 + (i * 7 + j) % 90 for j in range(n)], "blocks": tuple(range(i * 8, i * 8 + 8))}
            for i, n in enumerate(lengths)]
    prefill = StepPlan(query_lens=lengths, seq_lens=lengths,
                       block_tables=[s["blocks"][: -(-n // BLOCK)] for s, n in zip(seqs, lengths)],
                       token_ids=[t for s in seqs for t in s["tokens"]], logits_rows=[1] * len(lengths))
    assert torch.equal(eager.run(prefill), graphed.run(prefill))  # a prefill runs eagerly in both
    assert replays == []
    # every row count 1..8 (padded into buckets 3 -> 3, 5 -> 6, 7 -> 8), rows in changing orders
    steps = [[0], [1, 2], [0, 1, 2], [3, 2, 1, 0], [4, 0, 1, 2, 3], [5, 4, 3, 2, 1, 0], [6, 5, 4, 3, 2, 1, 0],
             list(range(8)), [7], [2, 6]]
    for rows in steps:
        plan = decode_plan(seqs, rows)
        a, b = eager.run(plan), graphed.run(plan)
        assert torch.equal(a, b), (rows, (a - b).abs().max())
    assert [n for _, n in replays] == [len(r) for r in steps]
    assert [bucket for bucket, _ in replays] == [1, 2, 3, 4, 6, 6, 8, 8, 1, 2]
    for (k, v), (gk, gv) in zip(eager.kv_caches, graphed.kv_caches):  # the pool's blocks, not the scratch one
        assert torch.equal(k, gk[:64]) and torch.equal(v, gv[:64])


def test_a_replay_on_one_thread_gives_the_bits_of_two():
    eager, graphed = runners(BLOCKS, max_running=4)
    seqs = [{"tokens": [3 + (i * 5 + j) % 70 for j in range(6 + i)], "blocks": tuple(range(i * 8, i * 8 + 8))}
            for i in range(4)]
    for s in seqs:  # the contexts' KV, written eagerly
        n = len(s["tokens"])
        plan = StepPlan(query_lens=[n], seq_lens=[n], block_tables=[s["blocks"][: -(-n // BLOCK)]],
                        token_ids=s["tokens"], logits_rows=[1])
        eager.run(plan), graphed.run(plan)
    replays = counting(graphed)
    for threads in (1, 2, 3, 1):
        graphed.graphs.threads = threads
        plan = decode_plan(seqs, [0, 1, 2, 3])
        assert torch.equal(eager.run(plan), graphed.run(plan)), threads
    assert len(replays) == 4


def test_an_op_the_replay_does_not_know_leaves_the_runner_eager_and_names_it(monkeypatch):
    monkeypatch.setattr(cpu_graphs, "_HANDLERS", {})
    real = cpu_graphs._handlers
    monkeypatch.setattr(cpu_graphs, "_handlers", lambda: {op: h for op, h in real().items()
                                                          if op is not torch.ops.pagoda_cpu.rope.default})
    eager, graphed = runners(BLOCKS)
    assert graphed.graphs is None
    assert graphed.graphs_summary.startswith("off: the step cannot be recorded (pagoda_cpu.rope.default: ")
    assert graphed.graphs_summary.endswith("every step runs eagerly")
    plan = StepPlan(query_lens=[3], seq_lens=[3], block_tables=[(0,)], token_ids=[5, 6, 7], logits_rows=[1])
    assert torch.equal(eager.run(plan), graphed.run(plan))
    plan = StepPlan(query_lens=[1], seq_lens=[4], block_tables=[(0,)], token_ids=[8], logits_rows=[1])
    assert torch.equal(eager.run(plan), graphed.run(plan))


def test_products_on_torchs_kernels_are_not_recorded():
    _, graphed = runners(None)  # float32 on oneDNN's products
    assert graphed.graphs is None and graphed.kv_caches[0][0].shape[0] == 64  # no scratch block either
    assert graphed.graphs_summary.startswith("off: the products run on onednn")


def test_a_replay_that_differs_from_its_recording_is_refused(monkeypatch):
    real = cpu_native.graph_run

    def drop_last_node(code, params, threads):  # a replay that skips the LM head
        real(code[:-2], params[:-2], threads)

    monkeypatch.setattr(cpu_native, "graph_run", drop_last_node)
    _, graphed = runners(BLOCKS, max_running=2)
    assert graphed.graphs is None
    assert "differs from its recording" in graphed.graphs_summary


def test_the_recorder_treats_views_as_no_work_and_refuses_unknown_ops():
    x = torch.randn(4, 6)
    with cpu_graphs.StepRecorder() as recorder:
        y = x.view(2, 12)[:, :6].t()  # views: no node
        z = y.contiguous()  # a copy
        z.add_(1.0)  # x + c
        z.add_(z, alpha=2.0)  # x + 2 y: refused
    assert [node[0] for node in recorder.code] == [cpu_graphs.COPY, cpu_graphs.SHIFT]
    assert recorder.refused is not None and "aten.add_" in recorder.refused
    with cpu_graphs.StepRecorder() as recorder:
        torch.tanh(x)
    assert recorder.refused is not None and "tanh" in recorder.refused and recorder.code == []


def test_the_gated_activation_is_silu_and_gelu_within_float32_rounding():
    gate_up = torch.randn(5, 2 * 37, generator=torch.Generator().manual_seed(3)) * 4  # 37: a tail past 8 lanes
    gate, up = gate_up.split(37, dim=-1)
    silu = cpu_native.act_mul(gate_up, "silu")
    torch.testing.assert_close(silu, torch.nn.functional.silu(gate.double()).float() * up, rtol=2e-6, atol=1e-6)
    gelu = cpu_native.act_mul(gate_up, "gelu_pytorch_tanh")
    want = torch.nn.functional.gelu(gate.double(), approximate="tanh").float() * up
    torch.testing.assert_close(gelu, want, rtol=2e-6, atol=1e-5)  # 1 + tanh cancels where gate << 0
    # each row alone gives the row's bits
    for r in range(5):
        assert torch.equal(cpu_native.act_mul(gate_up[r : r + 1], "silu"), silu[r : r + 1])
