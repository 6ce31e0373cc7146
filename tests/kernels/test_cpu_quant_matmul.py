"""pagoda's integer block products (Q4_0, Q4_1, Q8_0 weights, int8 activations): every ISA variant, tile,
thread split and row count gives the same bits, the product is the dequantized weights' by the dequantized
activations', and the packs hold exactly the gguf package's blocks."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from pagoda.kernels import cpu_native
from pagoda.model import matmul, quantize

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"{cpu_native.load()}")

FORMATS = ("q4_0", "q4_1", "q8_0")
SHAPES = [(37, 576), (50, 1536), (1, 32), (100, 64), (16, 96)]  # (N, K): N not a multiple of 16 but for one
ROWS = (1, 2, 3, 4, 5, 7, 8, 13, 33, 64, 70)


@contextlib.contextmanager
def isa(name):
    before = cpu_native.quant_isa(name)
    try:
        yield
    finally:
        cpu_native.quant_isa(before)


@contextlib.contextmanager
def threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def weight(fmt, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * (1 + torch.rand(n, 1, generator=gen))
    if fmt == "q4_1":
        w = w + torch.randn(n, 1, generator=gen)  # blocks with an offset
    return quantize.block_weight_from_float(w, fmt)


def activations(rows, k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 3
    x[:, :32] *= 0  # a zero block (scale 0)
    return x


def product(x, w):
    return quantize.block_linear(x, w, None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_isa_variant_gives_the_portable_bits(fmt):
    variants = cpu_native.quant_isas()
    assert variants[0] == "portable" and cpu_native.quant_isa() == variants[-1]  # the best runs by default
    for seed, (n, k) in enumerate(SHAPES):
        w = weight(fmt, n, k, seed)
        x = activations(max(ROWS), k, seed)
        with isa("portable"):
            want = {rows: product(x[:rows], w) for rows in ROWS}
        for name in variants[1:]:
            for t in (1, 2):
                with isa(name), threads(t):
                    for rows in ROWS:
                        assert torch.equal(product(x[:rows], w), want[rows]), (name, t, n, k, rows)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_bits_depend_on_nothing_else(fmt):
    """Every row count 1..70 (4-row tiles and their remainders), any position, 1 or 2 threads."""
    w = weight(fmt, 101, 576)
    probe, crowd = activations(1, 576, 2), activations(70, 576, 3)
    want = product(probe, w)[0]
    for n in range(1, 71):
        with threads(1 + n % 2):
            for at in {0, n // 2, n - 1}:
                x = crowd[:n].clone()
                x[at] = probe[0]
                assert torch.equal(product(x, w)[at], want), (n, at)
    strided = torch.cat((crowd[:5], crowd[:5]), dim=1)[:, :576]  # rows not contiguous with each other
    assert torch.equal(product(strided, w), product(strided.contiguous(), w))


@pytest.mark.parametrize("fmt", FORMATS)
def test_any_column_split_gives_the_same_bits(fmt):
    w = weight(fmt, 75, 576)
    x = activations(9, 576)
    want = product(x, w)
    code = quantize.BLOCK_FORMATS[fmt]
    for name in cpu_native.quant_isas():
        with isa(name):
            for bounds in ([0, 75], [0, 1, 17, 18, 40, 75], [0, 16, 32, 48, 64, 75], [0, 5, 74, 75], [0, 0, 3, 75]):
                got = torch.ops.pagoda_cpu.block_linear_columns(x, w.qs, w.d, w.m, code, 75, bounds)
                assert torch.equal(got, want), (name, bounds)


def test_activations_are_quantized_per_block_of_32():
    x = activations(6, 96)
    x[1, 32:38] = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 0.49])  # d = 1: ties go to the even integer
    xq, xd, xsum = torch.ops.pagoda_cpu.quantize_activations(x)
    blocks = x.reshape(6, 3, 32)
    d = blocks.abs().amax(dim=-1) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(blocks * inv[..., None])  # half to even
    assert torch.equal(xd, d) and torch.equal(xq.float(), q.reshape(6, 96))
    assert torch.equal(xsum, q.sum(dim=-1).int()) and xsum.dtype == torch.int32
    assert xq[1, 32:38].tolist() == [127, 2, 4, 0, -2, 0]
    assert (xq[:, :32] == 0).all() and (xd[:, 0] == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_product_is_the_dequantized_operands(fmt):
    for seed, (n, k) in enumerate(SHAPES):
        w = weight(fmt, n, k, seed)
        wd = quantize.dequantize(w).double()
        for rows in (1, 4, 9):
            x = activations(rows, k, seed + rows)
            xq, xd, _ = torch.ops.pagoda_cpu.quantize_activations(x)
            xdq = xq.double() * xd.double().repeat_interleave(32, dim=1)
            got = product(x, w)
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            exact = xdq @ wd.T
            scale = xdq.abs() @ wd.abs().T  # the size of the terms: float32 rounding is relative to it
            assert ((got.double() - exact).abs() <= 2e-6 * scale + 1e-30).all(), (n, k, rows)
            plain = x.double() @ wd.T  # int8 activations: about 1% of the terms' size
            assert ((got.double() - plain).abs() <= 2e-2 * (x.double().abs() @ wd.abs().T) + 1e-6).all(), (n, k, rows)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gguf_blocks_round_trip(fmt):
    gguf = pytest.importorskip("gguf")
    kind = getattr(gguf.GGMLQuantizationType, fmt.upper())
    n, k = 45, 192
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(4))
    w[3, 32:64] = 0  # an all-zero block
    blocks = gguf.quants.quantize(w.numpy(), kind)  # [N, K/32 * bytes] uint8
    packed = quantize.block_weight_from_gguf(torch.from_numpy(blocks.reshape(n, k // 32, -1).copy()), fmt)
    assert packed.out_features == n and packed.in_features == k and packed.format == fmt
    assert np.array_equal(quantize.dequantize(packed).numpy(), gguf.quants.dequantize(blocks, kind))
    ours = quantize.block_weight_from_float(w, fmt)  # the same rounding as the gguf package's quantizer
    assert torch.equal(ours.qs, packed.qs) and torch.equal(ours.d, packed.d) and torch.equal(ours.m, packed.m)
    assert packed.nbytes == packed.qs.nbytes + packed.d.nbytes + packed.m.nbytes


def test_the_matmul_kernel_packs_floats_to_q8_0():
    kernel = matmul.select_matmul("cpu", name="blocks")
    assert kernel is matmul.BLOCKS and kernel.row_multiple == 1
    w, bias, x = torch.randn(24, 64), torch.randn(24), torch.randn(3, 64)
    packed = kernel.pack(w)
    assert isinstance(packed, quantize.BlockWeight) and packed.format == "q8_0"
    got = kernel.linear(x, packed, bias)
    assert torch.equal(got, quantize.block_linear(x, packed, None) + bias)
    assert torch.equal(kernel.linear(x, w, bias), got)  # not packed yet: packs on the fly, the same bits
    assert (got - (x @ w.T + bias)).abs().max() < 0.05 * (x.abs() @ w.abs().T).max()


def test_what_it_cannot_take_is_refused_by_name():
    w = weight("q4_0", 16, 64)
    with pytest.raises(RuntimeError, match="inputs"):
        cpu_native.block_linear(torch.randn(2, 32), w.qs, w.d, w.m, 0, 16)
    with pytest.raises(RuntimeError, match="format"):
        cpu_native.block_linear(torch.randn(2, 64), w.qs, w.d, w.m, 7, 16)
    with pytest.raises(RuntimeError, match="qs must be"):
        cpu_native.block_linear(torch.randn(2, 64), w.qs, w.d, w.m, 2, 16)  # 4-bit blocks read as 8-bit
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize.block_weight_from_float(torch.randn(4, 40), "q8_0")
    with pytest.raises(ValueError, match="18"):
        quantize.block_weight_from_gguf(torch.zeros(4, 2, 18, dtype=torch.uint8), "q8_0")
    with pytest.raises(RuntimeError, match="unknown ISA"):
        cpu_native.quant_isa("sse9")
