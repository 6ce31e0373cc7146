"""LoRA adapters keep a row's answer its own: alone == in a crowd of base rows and other adapters' == preempted.

tests/model/test_batch_invariance.py's comparison with adapters: three peft-made adapters on the tiny model, the
targets on two of them, the crowd's others on the base and on each adapter in turn, so that steps carry base rows
and every adapter's at once (checked). Every logits row a target sampled from must have its alone bits, on a float
base and on integer bases (the adapters stay float). TP=2: tests/distributed/test_tp_tiny_invariance.py.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu_native
from pagoda.model.config import named_config
from pagoda.model.llama import build_model
from pagoda.model.matmul import INT4, INT8, INT8_AVX2, BLOCKS
from pagoda.model.quantize import has_int_kernels
from tests.distributed.helpers import save_model_dir
from tests.lora_files import hf_model, save_random_adapter
from tests.model.test_batch_invariance import GREEDY, SAMPLED, check_invariance, run

pytest.importorskip("peft")


def tiny_model(matmul=None):
    model = build_model(named_config("tiny"), max_positions=512, matmul=matmul)
    model.init_random_weights(seed=5, std=0.1)
    return model


def make_adapters(model_dir, out):
    """Three adapters of other ranks, targets and seeds."""
    hf = hf_model(model_dir)
    return {"a": save_random_adapter(hf, out / "a", rank=8, seed=1, std=0.1),
            "b": save_random_adapter(hf, out / "b", rank=16, seed=2, std=0.1, targets=("q_proj", "v_proj", "down_proj")),
            "c": save_random_adapter(hf, out / "c", rank=4, seed=3, std=0.1, rslora=True)}


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    return make_adapters(save_model_dir(tiny_model(), out / "tiny"), out)


def lora_targets():
    gen = torch.Generator().manual_seed(11)
    return [("greedy", torch.randint(3, 512, (13,), generator=gen).tolist(), GREEDY, "a"),
            ("sampled", torch.randint(3, 512, (22,), generator=gen).tolist(), SAMPLED, "b")]


def check_lora_invariance(model, adapters, ranks=None):
    targets = lora_targets()
    # the adapters matter: the greedy target's answer on its adapter is not the base's
    on_base, _, _ = run(model, [targets[0][:3]], ranks=ranks)
    on_adapter, _, _ = run(model, [targets[0]], ranks=ranks, adapters=adapters)
    assert on_base["greedy"] != on_adapter["greedy"], "adapter a does not change the answer: the test proves little"
    check_invariance(model, targets, tight_blocks=24, ranks=ranks, adapters=adapters)


def test_adapters_on_a_float_base_are_batch_invariant(tiny_adapters):
    check_lora_invariance(tiny_model(), tiny_adapters)


needs_int = pytest.mark.skipif(not has_int_kernels(), reason="torch lacks the CPU int8/int4 weight kernels")
needs_avx2 = pytest.mark.skipif(not cpu_native.available(), reason=f"{cpu_native.load()}")


@pytest.mark.parametrize("matmul", [pytest.param(INT8_AVX2, marks=needs_avx2), pytest.param(BLOCKS, marks=needs_avx2),
                                    pytest.param(INT8, marks=[needs_int, pytest.mark.slow]),
                                    pytest.param(INT4, marks=[needs_int, pytest.mark.slow])],
                         ids=lambda k: k.name)
def test_adapters_on_an_integer_base_are_batch_invariant(tiny_adapters, matmul):
    model = tiny_model(matmul)
    check_lora_invariance(model, tiny_adapters)


def test_adapters_on_the_float_kernel_are_batch_invariant(tiny_adapters, monkeypatch):
    """Where pagoda's C++ kernel does not run (no AVX2, a GPU), each adapter's rows are two products on the model's
    float kernel, in calls of the row counts this machine proved: the same comparison holds."""
    from pagoda.model import lora

    monkeypatch.setattr(lora, "native", lambda device: False)
    model = tiny_model()
    check_lora_invariance(model, tiny_adapters)
    engine = run(model, [lora_targets()[0]], adapters=tiny_adapters)[2]
    assert engine.runner.inner.lora_table is None
    assert all(isinstance(d, lora.ProductDelta) for d in engine.runner.inner.adapters["a"].modules.values())
