"""pagoda's C++ CPU kernels: the int8 products multiply by the dequantized weight, and a row's bits
never depend on anything else computed with it (the attention kernel's tests are in test_backends.py)."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"{cpu_native.load()}")


def int8_case(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) * 0.01
    return (q, scale), q.double() * scale.double()[:, None]


@pytest.mark.parametrize("n, k", [(96, 576), (37, 64), (1, 1536), (2050, 32)])
def test_the_product_is_by_the_dequantized_weight(n, k):
    linear = cpu_native.int8_linear
    operands, w = int8_case(n, k)
    for rows in (1, 3, 4, 5, 9, 64):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        got = linear(x, *operands)
        want = x.double() @ w.T
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max() + 1e-6, (rows, n, k)


def test_a_rows_bits_depend_on_nothing_else():
    """Every row count 1..70 (4-row tiles and their remainders), any position, any channel count, 1 or 2 threads."""
    linear = cpu_native.int8_linear
    operands, _ = int8_case(101, 576)  # 101 channels: full and partial tiles and blocks
    gen = torch.Generator().manual_seed(1)
    probe, crowd = torch.randn(1, 576, generator=gen), torch.randn(70, 576, generator=gen)
    want = linear(probe, *operands)[0]
    threads = torch.get_num_threads()
    try:
        for n in range(1, 71):
            torch.set_num_threads(1 + n % 2)
            for at in {0, n // 2, n - 1}:
                x = crowd[:n].clone()
                x[at] = probe[0]
                assert torch.equal(linear(x, *operands)[at], want), (n, at)
    finally:
        torch.set_num_threads(threads)
    strided = torch.cat((crowd[:5], crowd[:5]), dim=1)[:, :576]  # rows not contiguous with each other
    assert torch.equal(linear(strided, *operands), linear(strided.contiguous(), *operands))


def test_shapes_it_cannot_take_are_refused_by_name():
    (q, scale), _ = int8_case(16, 64)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        cpu_native.int8_linear(torch.randn(2, 60), q[:, :60].contiguous(), scale)
    with pytest.raises(RuntimeError, match="inputs"):
        cpu_native.int8_linear(torch.randn(2, 32), q, scale)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_native.int8_linear(torch.randn(2, 64, dtype=torch.float64), q, scale)


def test_the_library_is_built_once_into_a_cache_keyed_by_its_source(tmp_path, monkeypatch):
    assert list(cpu_native.cache_dir().glob("*.so")), "the loaded library lives in its cache directory"
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    here = cpu_native.cache_dir()
    assert here.parent == tmp_path / "kernels" and here.name.startswith("cpu-")
    assert cpu_native.cache_dir() == here  # the same source, torch and flags: the same directory


def test_rms_norm_is_the_torch_formula_and_a_rows_bits_depend_on_nothing_else():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(580, generator=gen)  # 580: a tail past the last 8-lane vector
    crowd = torch.randn(80, 580, generator=gen) * 3
    out = cpu_native.rms_norm(crowd, weight, 1e-5)
    want = (crowd.double() * (crowd.double().pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt()) * weight.double()
    assert (out.double() - want).abs().max() < 1e-5
    for n in (1, 2, 7, 64, 65, 80):  # row-parallel above 64 rows
        assert torch.equal(cpu_native.rms_norm(crowd[:n], weight, 1e-5), out[:n]), n
    assert torch.equal(cpu_native.rms_norm(crowd[40:41], weight, 1e-5)[0], out[40])


def test_rope_gives_the_torch_forms_bits():
    from pagoda.model.config import named_config
    from pagoda.model.llama import rope_tables

    cos, sin = rope_tables(named_config("smollm2-135m"), 64)
    qkv = torch.randn(5, 960)
    qk = qkv[:, : 576 + 192].view(5, 12, 64)  # a strided view into the projection, as the model passes it
    got = cpu_native.rope(qk, cos[3:8], sin[3:8])
    swapped = torch.cat((qk[..., 32:], qk[..., :32]), -1).mul_(sin[3:8][:, None, :])
    assert torch.equal(got, torch.mul(qk, cos[3:8][:, None, :]).add_(swapped)) and got.is_contiguous()


def test_where_nothing_can_be_built_it_says_why_instead_of_failing(tmp_path, monkeypatch):
    blocked = tmp_path / "a file, not a directory"
    blocked.write_text("")
    monkeypatch.setenv("PAGODA_HOME", str(blocked))
    reason = cpu_native.load.__wrapped__()  # the uncached load: a fresh process's first call
    assert reason is not None and "did not build" in reason
