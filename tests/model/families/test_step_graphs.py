"""CPU step graphs on every family: each architecture plugin's model, on pagoda's block products (w8a8), records
its decode step with no code of its own and replays it with the eager step's bits; a family whose step holds an op
the replay does not know runs eagerly and the runner names the op."""

from __future__ import annotations

import pytest
import torch

from pagoda.core.engine_config import EngineConfig
from pagoda.kernels import cpu_native
from pagoda.model.loader import load_model
from pagoda.model.runner import StepPlan, TorchModelRunner
from tests.model.families import (
    test_gemma3,
    test_llama_families,
    test_phi3,
    test_qwen3,
    test_qwen3_moe,
)
from tests.model.families.family_checks import save_random_hf
from tests.model.test_cuda_graphs import BLOCK, decode_plan

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"{cpu_native.load()}")

LLAMAS = test_llama_families.FAMILIES
# family -> (config class, model class, config fields, whether its step records)
FAMILIES = {
    **{name: (c, m, {**test_llama_families.SMALL, **extra}, True) for name, (c, m, extra) in LLAMAS.items()},
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, test_qwen3.SMALL, True),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, test_phi3.SMALL, True),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, test_gemma3.SMALL, True),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, test_qwen3_moe.SMALL, False),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_replays_its_decode_step_bitwise_or_says_why_not(tmp_path, family):
    config_cls, model_cls, fields, records = FAMILIES[family]
    _, d = save_random_hf(tmp_path, config_cls, model_cls, std=0.1, **fields)
    model, _ = load_model(d, "float32", "cpu", max_positions=256, quantization="w8a8")
    config = EngineConfig(num_blocks=64, block_size=BLOCK, max_running=4, max_model_len=128, cpu_graphs=False)
    eager = TorchModelRunner(model, config)
    graphed = TorchModelRunner(model, EngineConfig(**{**config.__dict__, "cpu_graphs": True}))
    assert (graphed.graphs is not None) == records, graphed.graphs_summary
    if not records:
        assert graphed.graphs_summary.startswith("off: the step cannot be recorded ("), graphed.graphs_summary
        print(family, graphed.graphs_summary)
    lengths = [5, 11, 3, 9]
    seqs = [{"tokens": [3 + (i * 7 + j) % 90 for j in range(n)], "blocks": tuple(range(i * 16, i * 16 + 16))}
            for i, n in enumerate(lengths)]
    prefill = StepPlan(query_lens=lengths, seq_lens=lengths,
                       block_tables=[s["blocks"][: -(-n // BLOCK)] for s, n in zip(seqs, lengths)],
                       token_ids=[t for s in seqs for t in s["tokens"]], logits_rows=[1] * 4)
    assert torch.equal(eager.run(prefill), graphed.run(prefill))
    before = graphed.graphs.replays if records else 0
    for rows in [[0, 1, 2, 3], [2], [1, 3], [0, 2, 3], [3, 2, 1, 0]]:
        plan = decode_plan(seqs, rows)
        assert torch.equal(eager.run(plan), graphed.run(plan)), rows
    if records:
        assert graphed.graphs.replays - before == 5
