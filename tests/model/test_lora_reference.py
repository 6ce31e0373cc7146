"""LoRA adapters through pagoda against `peft`'s own model, on the same base weights.

Adapters are made by the peft library with random A and B (peft starts B at zero, which would prove nothing),
on the tiny model's shapes and the default model's, at ranks 8 and 64, plain and rsLoRA, on every projection or a
few, and on Phi-3's fused projections. Each is loaded by pagoda from the PEFT directory peft wrote. Prompt logits at
every position, paged and in chunks, must be within the exact path's tolerance of peft's (float32: 1e-4 on the tiny
shapes, as the families' checks; 1e-3 on the default model's 30 layers, as tests/model/test_hf_reference.py), while
the adapter moves them by far more (checked), and greedy decoding through the engine must give peft's tokens.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.core.engine_config import EngineConfig
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.config import named_config
from pagoda.model.factory import make_engine
from pagoda.model.llama import build_model
from pagoda.model.loader import load_model
from pagoda.model.runner import StepPlan
from tests.distributed.helpers import save_model_dir
from tests.lora_files import ALL_LINEARS, adapted_hf, hf_model, save_random_adapter
from tests.model_fixtures import default_model_dir  # noqa: F401  (session fixture)

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

ATOL = 1e-4
DEFAULT_ATOL = 1e-3  # tests/model/test_hf_reference.py's LOGITS_ATOL: 30 layers of summation order


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    whole = build_model(named_config("tiny"), max_positions=512)
    whole.init_random_weights(seed=5, std=0.1)
    return save_model_dir(whole, tmp_path_factory.mktemp("tiny") / "tiny")


def prompt_logits(engine, name, ids, chunk):
    """Logits [T, V] of every prompt position under adapter `name`, computed in chunks of `chunk` rows."""
    runner, size = engine.runner, engine.runner.block_size
    table = tuple(range(-(-len(ids) // size)))
    rows = []
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        plan = StepPlan(query_lens=[end - start], seq_lens=[end], block_tables=[table], token_ids=ids[start:end],
                        logits_rows=[end - start], adapters=(name,) if name else ())
        rows.append(runner.run(plan))
    return torch.cat(rows)


def check_against_peft(model_dir, adapter_dir, *, max_rank, num_tokens=40, new_tokens=12, atol=ATOL):
    hf = hf_model(model_dir)
    peft_model = adapted_hf(hf, adapter_dir)
    model, config = load_model(model_dir, "float32", "cpu", max_positions=512)
    engine = make_engine(model, EngineConfig(num_blocks=64, block_size=4, max_running=4, max_batched_tokens=64,
                                             max_model_len=512, max_lora_rank=max_rank))
    info = engine.load_adapter("ad", str(adapter_dir))
    ids = torch.randint(3, config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        theirs = peft_model(torch.tensor([ids])).logits[0]
        base = hf(torch.tensor([ids])).logits[0]
    assert (theirs - base).abs().max() > 100 * atol, "the adapter hardly changes the logits: the test proves little"
    for chunk in (num_tokens, 7):
        ours = prompt_logits(engine, "ad", ids, chunk)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=atol)
    torch.testing.assert_close(prompt_logits(engine, None, ids, num_tokens), base, rtol=0, atol=atol)

    prompt, expected = ids[:10], []
    with torch.no_grad():  # peft's argmax, step by step
        for _ in range(new_tokens):
            expected.append(int(peft_model(torch.tensor([prompt + expected])).logits[0, -1].argmax()))
    engine.add_request("r", prompt, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True),
                       adapter="ad")
    got = [t for out in engine.run() for t in out.new_token_ids]
    assert got == expected, f"greedy tokens differ from peft's: {got} != {expected}"
    engine.audit()
    return info


@pytest.mark.parametrize("rank, rslora, targets", [
    (8, False, ALL_LINEARS),
    (64, False, ALL_LINEARS),
    (16, True, ALL_LINEARS),
    (8, False, ("q_proj", "v_proj")),
    (8, False, ("k_proj", "o_proj", "up_proj", "down_proj")),
], ids=["r8", "r64", "r16-rslora", "r8-qv", "r8-kou-down"])
def test_tiny_model_matches_peft(tiny_dir, tmp_path, rank, rslora, targets):
    adapter = save_random_adapter(hf_model(tiny_dir), tmp_path / "ad", rank=rank, alpha=2.0 * rank, rslora=rslora,
                                  targets=targets, std=0.1)
    info = check_against_peft(tiny_dir, adapter, max_rank=64)
    assert info.rank == rank and set(info.target_modules) == set(targets)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [8, 64])
def test_default_model_matches_peft(default_model_dir, tmp_path, rank):  # noqa: F811
    adapter = save_random_adapter(hf_model(default_model_dir), tmp_path / "ad", rank=rank, alpha=16.0, std=0.02)
    check_against_peft(default_model_dir, adapter, max_rank=64, num_tokens=24, new_tokens=8, atol=DEFAULT_ATOL)


def test_phi3_fused_projections_match_peft(tmp_path):
    from tests.model.families.test_phi3 import save

    _, model_dir = save(tmp_path)
    adapter = save_random_adapter(hf_model(model_dir), tmp_path / "ad", rank=8, targets=("qkv_proj", "o_proj",
                                                                                          "gate_up_proj", "down_proj"),
                                  std=0.1)
    check_against_peft(model_dir, adapter, max_rank=16)


def test_the_float_kernel_path_matches_peft(tiny_dir, tmp_path, monkeypatch):
    """The deltas as products on the model's float kernel (where pagoda's C++ kernel does not run)."""
    from pagoda.model import lora

    monkeypatch.setattr(lora, "native", lambda device: False)
    adapter = save_random_adapter(hf_model(tiny_dir), tmp_path / "ad", rank=8, std=0.1)
    check_against_peft(tiny_dir, adapter, max_rank=16)
