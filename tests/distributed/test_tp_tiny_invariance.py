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
