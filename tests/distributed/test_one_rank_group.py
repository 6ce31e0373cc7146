"""A group of one rank on torch.distributed (`--distributed-backend` with no --tensor-parallel-size) runs every
collective through the backend, and answers with the bits of the single-process path: on the CPU over gloo, and
on a GPU over NCCL (the NCCL code path on a machine with one GPU; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from pagoda.core.sampling_params import SamplingParams
from pagoda.core.tokenizer import Tokenizer
from pagoda.model.factory import EngineOptions, load_engine
from tests.model_fixtures import default_model_dir  # noqa: F401  (session fixture)

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def answer(model_dir, **options):
    tokenizer = Tokenizer.from_dir(model_dir)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Name three colours of the rainbow."}])
    engine = load_engine(model_dir, tokenizer, EngineOptions(model=str(model_dir), num_blocks=32, **options))
    try:
        engine.add_request("r", prompt, GREEDY)
        tokens = [t for out in engine.run() for t in out.new_token_ids]
        return tokens, engine.describe(), dict(getattr(engine.runner, "ranks", None).group.stats.calls
                                               if "tensor_parallel" in engine.describe() else {})
    finally:
        engine.close()


@pytest.mark.parametrize("device, backend", [
    ("cpu", "gloo"),
    pytest.param("cuda", "nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                            reason="needs CUDA")]),
])
def test_a_one_rank_group_runs_its_collectives_and_gives_the_single_process_tokens(default_model_dir, device,  # noqa: F811
                                                                                   backend):
    dtype = "float32" if device == "cpu" else "bfloat16"
    alone, described, _ = answer(default_model_dir, device=device, dtype=dtype)
    grouped, described, calls = answer(default_model_dir, device=device, dtype=dtype, distributed_backend=backend)
    assert described["tensor_parallel"]["size"] == 1 and described["tensor_parallel"]["backend"] == backend
    assert calls["all_reduce"] > 0 and calls["gather"] > 0 and calls["broadcast"] > 0  # it really communicated
    assert grouped == alone
