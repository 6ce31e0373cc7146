"""The tiny model's alone / crowd / preempted comparison (tests/model/test_batch_invariance.py) at TP=2: its 2 KV
heads split 1 + 1, and its greedy target repeats itself, so drafts are accepted too.

A module of its own: a process holds one tensor-parallel group at a time, and test_tensor_parallel.py's
module-wide group of the default model would still be up.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.model.config import named_config
from pagoda.model.llama import build_model
from tests.distributed.helpers import save_model_dir, tp_model
from tests.model.test_batch_invariance import GREEDY, SAMPLED, check_invariance

pytestmark = pytest.mark.slow


def test_tp2_tiny_model_is_batch_invariant(tmp_path):
    whole = build_model(named_config("tiny"), max_positions=512)
    whole.init_random_weights(seed=5, std=0.1)  # the single-process test's model: it repeats, so drafts land
    with tp_model(save_model_dir(whole, tmp_path / "tiny"), 2, max_model_len=512) as (model, ranks):
        assert model.shard.num_kv_heads == 1
        gen = torch.Generator().manual_seed(11)
        targets = [
            ("greedy", torch.randint(3, 512, (13,), generator=gen).tolist(), GREEDY),
            ("sampled", torch.randint(3, 512, (22,), generator=gen).tolist(), SAMPLED),
        ]
        check_invariance(model, targets, tight_blocks=24, ranks=ranks)


def test_tp2_adapters_are_batch_invariant(tmp_path):
    """Base rows and three adapters' in one step, each adapter's A and B split over the ranks as their base
    projection is (tests/model/test_lora_invariance.py's comparison)."""
    pytest.importorskip("peft")
    from tests.model.test_lora_invariance import check_lora_invariance, make_adapters, tiny_model

    model_dir = save_model_dir(tiny_model(), tmp_path / "tiny")
    adapters = make_adapters(model_dir, tmp_path)
    with tp_model(model_dir, 2, max_model_len=512) as (model, ranks):
        check_lora_invariance(model, adapters, ranks=ranks)
        # and split right: the group's logits are peft's
        from pagoda.core.engine_config import EngineConfig
        from pagoda.model.factory import make_engine
        from tests.lora_files import adapted_hf, hf_model
        from tests.model.test_lora_reference import ATOL, prompt_logits

        engine = make_engine(model, EngineConfig(num_blocks=32, block_size=4, max_model_len=512, max_lora_rank=16),
                             ranks=ranks)
        ids = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(3)).tolist()
        for name in ("b", "c"):
            engine.load_adapter(name, str(adapters[name]))
            with torch.no_grad():
                theirs = adapted_hf(hf_model(model_dir), adapters[name])(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(prompt_logits(engine, name, ids, 30), theirs, rtol=0, atol=ATOL)


def test_rank_0_failing_inside_a_step_fails_the_group_not_just_the_batch(tmp_path, monkeypatch):
    from pagoda.core.engine_config import EngineConfig
    from pagoda.core.sampling_params import SamplingParams
    from pagoda.distributed.group import GroupFailure
    from pagoda.model.factory import make_engine

    whole = build_model(named_config("tiny"), max_positions=512)
    whole.init_random_weights(seed=5, std=0.1)
    with tp_model(save_model_dir(whole, tmp_path / "tiny"), 2, max_model_len=512) as (model, ranks):
        engine = make_engine(model, EngineConfig(num_blocks=32, block_size=16, max_model_len=512), ranks=ranks)
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))

        def out_of_memory(x):
            raise RuntimeError("out of memory")

        # after the plan went out and the first all-reduces ran: rank 1 is left inside the step
        monkeypatch.setattr(model.model.norm, "forward", out_of_memory)
        with pytest.raises(GroupFailure, match="rank 0 failed inside a step"):
            engine.step()
        assert ranks.group.failure is not None
    assert not any(p.is_alive() for p in ranks.processes)  # the stranded rank was killed, not waited for


def test_tp2_splits_phi3_fused_adapters_as_their_projections(tmp_path):
    """A fused qkv (gate_up) adapter's B is cut into its q, k and v (gate and up) rows, each rank keeping its heads'
    (its part of the intermediate size): the group's logits are peft's."""
    pytest.importorskip("peft")
    from pagoda.core.engine_config import EngineConfig
    from pagoda.model.factory import make_engine
    from tests.lora_files import adapted_hf, hf_model, save_random_adapter
    from tests.model.families.test_phi3 import save
    from tests.model.test_lora_reference import ATOL, prompt_logits

    _, model_dir = save(tmp_path)
    hf = hf_model(model_dir)
    adapter = save_random_adapter(hf, tmp_path / "ad", targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
                                  std=0.1)
    with tp_model(model_dir, 2, max_model_len=512) as (model, ranks):
        assert model.shard.num_kv_heads == 1
        engine = make_engine(model, EngineConfig(num_blocks=32, block_size=4, max_model_len=512), ranks=ranks)
        engine.load_adapter("ad", str(adapter))
        ids = torch.randint(3, 320, (30,), generator=torch.Generator().manual_seed(3)).tolist()
        with torch.no_grad():
            theirs = adapted_hf(hf, adapter)(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(prompt_logits(engine, "ad", ids, 30), theirs, rtol=0, atol=ATOL)


def test_tp2_a_load_a_rank_cannot_read_fails_everywhere_and_the_group_serves_on(tmp_path):
    """Rank 0 reads the adapter, then its directory is gone before the others read theirs (a machine without it):
    the load is refused naming lora_path, no rank keeps it, and the group serves the next request; a later load
    and unload reach every rank."""
    pytest.importorskip("peft")
    import shutil

    from pagoda.core.adapters import AdapterError
    from pagoda.core.engine_config import EngineConfig
    from pagoda.core.sampling_params import SamplingParams
    from pagoda.model.factory import make_engine
    from tests.model.test_lora_invariance import make_adapters, tiny_model

    model_dir = save_model_dir(tiny_model(), tmp_path / "tiny")
    adapters = make_adapters(model_dir, tmp_path)
    gone = shutil.copytree(adapters["a"], tmp_path / "gone")
    with tp_model(model_dir, 2, max_model_len=512) as (model, ranks):
        engine = make_engine(model, EngineConfig(num_blocks=32, block_size=4, max_model_len=512), ranks=ranks)
        prepared = engine.prepare_adapter("x", str(gone))
        shutil.rmtree(gone)
        with pytest.raises(AdapterError, match="could not load") as refused:
            engine.install_adapter(prepared)
        assert refused.value.field == "lora_path" and engine.adapters.loaded == {} and engine.runner.adapters == {}
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

        def answer(adapter=None):
            engine.add_request("r", [5, 6, 7, 8], params, adapter=adapter)
            return [t for out in engine.run() for t in out.new_token_ids]

        base = answer()
        engine.load_adapter("x", str(adapters["a"]))
        assert answer("x") != base  # every rank holds x: a rank without it would fail the step
        assert engine.unload_adapter("x").done() and answer() == base
        engine.audit()
