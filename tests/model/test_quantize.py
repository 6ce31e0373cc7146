"""The int8 and int4 weight formats: rounding, packing, the GGUF Q4_1 blocks, and how they are chosen."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.kernels import cpu_native
from pagoda.model.matmul import BLOCKS, INT4, INT8, INT8_AVX2, ONEDNN_BF16, QUANTIZATIONS, quantized_matmul
from pagoda.model.quantize import (GROUP_SIZE, Int4Weight, dequantize, has_int_kernels, int4_from_q4_1, int4_linear,
                                   int4_values, int8_avx2_linear, int8_linear, quantize_int4, quantize_int8,
                                   quantize_int8_float_scales)
from tests.model_fixtures import default_gguf_path, default_model_dir  # noqa: F401  (session fixtures)

pytestmark = pytest.mark.skipif(not has_int_kernels(), reason="torch lacks the CPU int8/int4 weight kernels")


def weight(n=96, k=576, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int8_rounds_each_output_channel_to_nearest():
    w = weight()
    packed = quantize_int8(w)
    assert packed.qweight.dtype == torch.int8 and packed.scales.shape == (96,)
    assert packed.qweight.abs().max() == 127  # each channel's largest weight maps to the end of the range
    step = packed.scales.float()[:, None]
    assert ((dequantize(packed) - w).abs() <= step * 0.5 + 1e-6).all()  # at most half a step off
    assert packed.nbytes < w.nbytes / 3


def test_int4_rounds_each_group_to_nearest_between_its_min_and_max():
    w = weight()
    packed = quantize_int4(w)
    assert packed.packed.dtype == torch.uint8 and packed.scales_zeros.shape == (576 // GROUP_SIZE, 96, 2)
    q = int4_values(packed)
    assert q.min() == 0 and q.max() == 15 and torch.equal(q, q.round())
    scale = packed.scales_zeros[..., 0].float().t().repeat_interleave(GROUP_SIZE, dim=1)
    assert ((dequantize(packed) - w).abs() <= scale * 0.5 + 1e-6).all()
    assert packed.nbytes < w.nbytes / 6


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_kernel_multiplies_by_the_dequantized_weight(fmt):
    quantize, linear = (quantize_int8, int8_linear) if fmt == "int8" else (quantize_int4, int4_linear)
    w, x, bias = weight(), torch.randn(5, 576), torch.randn(96)
    packed = quantize(w)
    want = x.to(torch.bfloat16).float() @ dequantize(packed).T + bias
    got = linear(x, packed, bias)
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-2)  # the kernel's output is rounded to bfloat16
    torch.testing.assert_close(linear(x, w, bias), got, rtol=0, atol=0)  # an unpacked weight: quantized on the fly


@pytest.mark.skipif(not cpu_native.available(), reason=f"{cpu_native.load()}")
def test_pagodas_int8_kernel_multiplies_by_the_dequantized_weight_in_float32():
    w, x, bias = weight(), torch.randn(5, 576), torch.randn(96)
    packed = quantize_int8_float_scales(w)
    assert packed.scales.dtype == torch.float32 and ((dequantize(packed) - w).abs() <= packed.scales[:, None] / 2 + 1e-7).all()
    got = int8_avx2_linear(x, packed, bias)
    want = x.double() @ dequantize(packed).double().T + bias.double()
    assert (got.double() - want).abs().max() < 1e-4  # float32 activations and output: nothing rounded to bfloat16
    torch.testing.assert_close(int8_avx2_linear(x, w, bias), got, rtol=0, atol=0)  # quantized on the fly
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_int8_float_scales(torch.zeros(16, 60))


def test_int4_refuses_shapes_torch_cannot_pack():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.zeros(16, 40))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_int4(torch.zeros(8, 64))


def q4_1_blocks(d, m, q):
    """Q4_1 blocks [N, K/32, 20] from d, m [N, K/32] float16 and q [N, K] in 0..15 (gguf's byte layout)."""
    n, groups = d.shape
    q = q.reshape(n, groups, 32).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([d[..., None].view(torch.uint8), m[..., None].view(torch.uint8), qs], dim=-1)


def test_q4_1_blocks_keep_their_q_and_their_scales_become_scale_d_and_zero_m_plus_8d():
    gen = torch.Generator().manual_seed(3)
    d = (torch.rand(32, 4, generator=gen) * 0.01).half()
    m = (-torch.rand(32, 4, generator=gen) * 0.05).half()
    q = torch.randint(0, 16, (32, 128), generator=gen)
    packed = int4_from_q4_1(q4_1_blocks(d, m, q))
    assert torch.equal(int4_values(packed), q.float())  # no second rounding of q
    exact = q.float() * d.float().repeat_interleave(32, 1) + m.float().repeat_interleave(32, 1)
    # the kernel's scales are bfloat16: d and m + 8d are rounded to 8 significant bits
    assert (dequantize(packed) - exact).abs().max() <= 0.004 * exact.abs().max()


def test_the_default_models_q4_1_blocks_give_ggufs_own_q(default_gguf_path, default_model_dir):  # noqa: F811
    """The imported blocks, through the pack, against gguf's own dequantization of the same tensor."""
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize
    from safetensors import safe_open

    from pagoda.model.gguf_import import Q4_1_BLOCKS_FILE

    reader = GGUFReader(default_gguf_path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")  # no row reordering
    theirs = torch.from_numpy(np.asarray(gguf_dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
    theirs = theirs.reshape(576, 1536)
    with safe_open(str(default_model_dir / Q4_1_BLOCKS_FILE), framework="pt") as f:
        blocks = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    packed = int4_from_q4_1(blocks)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float().repeat_interleave(32, 1)  # [576, 1536]
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float().repeat_interleave(32, 1)
    assert torch.equal(int4_values(packed) * d + m, theirs)  # the same q, d and m as gguf's float32
    relative = (dequantize(packed) - theirs).abs().max() / theirs.abs().max()
    assert 0 < relative <= 0.004, relative  # only the bfloat16 rounding of the scales and zeros


def test_int4_loads_the_default_model_from_its_blocks(default_model_dir):  # noqa: F811
    from pagoda.model.loader import load_model, weight_format

    model, _ = load_model(default_model_dir, "auto", "cpu", max_positions=64, quantization="int4")
    layers = model.model.layers
    head = "int8_avx2" if cpu_native.available() else "int8"  # the int8 head on pagoda's kernel where it builds
    assert model.matmul is INT4 and weight_format(model) == f"int4 (LM head {head})"
    down = layers[0].mlp.down_proj
    assert isinstance(down.packed.packed, Int4Weight) and down.packed.released and down.weight.numel() == 0
    assert next(model.parameters()).dtype == torch.float32  # norms, embedding, residual stream
    for head, want in (("int4", "int4"), ("float", "int4 (LM head onednn")):
        other, _ = load_model(default_model_dir, "auto", "cpu", max_positions=64, quantization="int4", lm_head=head)
        assert weight_format(other).startswith(want)
    with pytest.raises(ValueError, match="lm_head must be one of"):
        load_model(default_model_dir, "auto", "cpu", max_positions=64, quantization="int4", lm_head="int2")


def test_quantization_values_and_devices(default_model_dir, tmp_path):
    from pagoda.model.loader import resolve_quantization

    assert QUANTIZATIONS == ("none", "int8", "int4", "gguf", "w8a8", "auto")
    assert quantized_matmul("none", "cpu") is None
    # auto: a GGUF's own blocks on a CPU that runs pagoda's kernels (the default model is a GGUF), else none
    native = cpu_native.available()
    assert resolve_quantization("auto", default_model_dir, "cpu") == ("gguf" if native else "none")
    assert resolve_quantization("auto", tmp_path, "cpu") == "none"  # no GGUF blocks: a float checkpoint
    assert resolve_quantization("auto", default_model_dir, "cuda") == "none"
    assert resolve_quantization("int8", default_model_dir, "cpu") == "int8"
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantized_matmul("auto", "cpu")  # resolved by the loader first
    if native:
        assert quantized_matmul("gguf", "cpu") is quantized_matmul("w8a8", "cpu") is BLOCKS
    assert quantized_matmul("int8", "cpu") is (INT8_AVX2 if native else INT8)
    assert quantized_matmul("int4", "cpu") is INT4
    with pytest.raises(ValueError, match="CPU only"):
        quantized_matmul("int4", "cuda")
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantized_matmul("int3", "cpu")
    assert ONEDNN_BF16.row_multiple >= INT4.row_multiple == INT8.row_multiple == 1


def test_the_cli_refuses_an_unknown_quantization(capsys):
    from pagoda.cli.main import main

    for command in (["serve"], ["generate", "hi"], ["bench", "offline"]):
        with pytest.raises(SystemExit) as exc:
            main([*command, "--quantization", "int3"])
        assert exc.value.code == 2
        assert "--quantization" in capsys.readouterr().err


def test_the_startup_log_names_the_weight_format(default_model_dir, caplog):  # noqa: F811
    from pagoda.core.tokenizer import Tokenizer
    from pagoda.model.factory import EngineOptions, load_engine

    options = EngineOptions(model=str(default_model_dir), device="cpu", quantization="int4", num_blocks=8,
                            max_model_len=64)
    with caplog.at_level("INFO", logger="pagoda.model"):
        load_engine(default_model_dir, Tokenizer.from_dir(default_model_dir), options)
    (line,) = [r.getMessage() for r in caplog.records if "weights" in r.getMessage()]
    head = "int8_avx2" if cpu_native.available() else "int8"
    assert f"weights int4 (LM head {head}), KV cache float32" in line
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineOptions(quantization="int2")
