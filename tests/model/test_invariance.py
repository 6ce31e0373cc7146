"""The start-up probe: it finds where a product's rows stop keeping their bits, caps the calls below that, caches
what it found per machine and shape, and lifts every cap when invariance is turned off."""

from __future__ import annotations

import torch

from pagoda.core.engine_config import EngineConfig
from pagoda.model import invariance
from pagoda.model.config import named_config
from pagoda.model.factory import make_engine
from pagoda.model.invariance import prove_row_invariance
from pagoda.model.llama import build_model
from pagoda.model.matmul import MatmulKernel, PackedWeight


def _switching(x, weight, bias):
    """A product that changes its summation order from 9 rows on, as a BLAS switching kernels does."""
    if x.shape[0] <= 8:
        return x @ weight.T
    return (x.double() @ weight.double().T).float()  # other rounding: some rows get other bits


SWITCHING = MatmulKernel("switching", 4, _switching)


def _pack(kernel=SWITCHING, shape=(48, 32)):
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    packed = PackedWeight(kernel)
    packed.pack(weight)
    return packed, weight


def test_the_probe_caps_calls_below_the_switch_and_every_row_keeps_its_alone_bits(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    packed, weight = _pack()
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(1))
    uncapped = packed.product(x, weight, None)
    alone = torch.cat([packed.product(torch.cat((x[i : i + 1], x.new_zeros(3, 32))), weight, None)[:1]
                       for i in range(40)])
    assert not torch.equal(uncapped, alone)  # the hazard is real: one 40-row call changes rows
    report = prove_row_invariance([(packed, weight)])
    assert packed.max_rows == 8 and report.products["switching 48x32"] == invariance.RowProbe(8, 12)
    assert torch.equal(packed.product(x, weight, None), alone)  # five calls of 8 rows: every row as alone
    assert "in calls of at most 8 rows (a 12-row call changed a row's bits)" in report.summary()
    assert report.describe()["on"] and report.proven


def test_the_probe_is_cached_per_machine_and_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    packed, weight = _pack()
    prove_row_invariance([(packed, weight)])
    assert len(list((tmp_path / "invariance").iterdir())) == 1

    def fail(*args, **kwargs):
        raise AssertionError("probed again despite the cache")

    monkeypatch.setattr(invariance, "probe_rows", fail)
    again, weight = _pack()
    prove_row_invariance([(again, weight)])
    assert again.max_rows == 8
    other, weight = _pack(shape=(64, 32))  # another shape is probed anew
    monkeypatch.undo()
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    prove_row_invariance([(other, weight)])
    assert len(list((tmp_path / "invariance").iterdir())) == 2


def test_off_lifts_every_cap_and_says_answers_may_depend_on_the_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    packed, weight = _pack()
    prove_row_invariance([(packed, weight)])
    assert packed.max_rows == 8
    report = prove_row_invariance([(packed, weight)], batch_invariant=False)
    assert packed.max_rows == 0 and report.products == {}
    assert report.describe()["on"] is False and "may depend on the batch" in report.summary()


def test_the_engine_setting_reaches_the_runner_and_its_description(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    for on in (True, False):
        model = build_model(named_config("tiny"), max_positions=64)
        model.init_random_weights(seed=0)
        engine = make_engine(model, EngineConfig(num_blocks=8, block_size=4, max_model_len=32, batch_invariant=on))
        described = engine.runner.describe()
        assert described["batch_invariant"]["on"] is on
        assert set(described["machine"]) >= {"cpu", "isa", "cores"} and described["kernels"]["matmul"]
        assert bool(engine.runner.invariance.products) is on


def test_off_the_cpu_the_report_names_the_kernels_and_proves_only_the_invariant_ones():
    from pagoda.model.matmul import PLAIN, TRITON_INVARIANT

    meta = torch.empty(48, 32, device="meta")  # a weight off the CPU: not probed, judged by its kernel
    chosen = prove_row_invariance([(PackedWeight(TRITON_INVARIANT), meta)])
    assert chosen.proven and chosen.summary().startswith("on: triton_invariant")
    plain = prove_row_invariance([(PackedWeight(PLAIN), meta)])
    assert not plain.proven and "NOT proven" in plain.summary()
