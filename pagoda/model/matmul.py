"""How the model multiplies: the matmul kernels, their weight packing, and the Linear layer over them.

Design note. Batch invariance (see `runner.py`) needs a matrix product whose
bits for one row do not depend on the other rows. A `MatmulKernel` names such
a product and the row multiple for which it holds; the model picks one kernel
when it is built (`select_matmul`) and every `Linear` runs on it. Kernels that
want their own weight layout (oneDNN's blocked one) reorder each weight once
into a `PackedWeight`, which is redone when the weight changes in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagoda.kernels import cpu_native
from pagoda.model import quantize


@dataclass(frozen=True)
class MatmulKernel:
    """How every linear layer multiplies, and the row multiple that keeps a row's bits batch invariant.

    The caller pads the rows of a forward to a multiple of `row_multiple`;
    for those row counts the kernel gives each row the same bits whatever
    the other rows are (measured by tests/model/test_llama.py on the machine that
    runs them). `row_multiple` 1 claims nothing.
    """

    name: str
    row_multiple: int
    linear: Callable[[Tensor, Any, Tensor | None], Tensor]  # (x, weight or pack(weight), bias)
    pack: Callable[[Tensor], Any] | None = None  # weight [out, in] -> the kernel's own layout (a tensor or a pack)
    # a product of fewer multiply-adds (rows x in x out) runs on the one thread of a small step: waking a
    # sleeping OpenMP thread costs more than it saves (runner.py's design note)
    min_parallel_work: int = 0


def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_pack(weight: Tensor) -> Tensor:
    # no row-count hint: oneDNN picks a blocked layout for a row count known only at run time
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


# oneDNN's fp32 matmul takes one path for every row count >= 2 (1 row is a
# matrix-vector product with other rounding), and streams the weights faster
# than MKL sgemm for the few-row products of decoding.
ONEDNN = MatmulKernel("onednn", 2, _onednn_linear)
# The same products on weights reordered once into oneDNN's blocked layout: the
# per-call reorder is gone, and 4-row products stream the weights fastest (a
# decode's lone row is padded to 4, not 2). Rows are bit-identical for every
# row count >= 2 (a lone row with more than 1024 inputs takes another path).
ONEDNN_PACKED = MatmulKernel("onednn_packed", 4, _onednn_linear, _onednn_pack)
# MKL sgemm computes rows in groups of four; a row in a remainder group (or a
# lone row) takes another path. Padding to four rows is slower than oneDNN.
MKL_PADDED = MatmulKernel("mkl", 4, F.linear)


def _bf16_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    # x [T, in] float32 -> bfloat16 operands, float32 accumulation in oneDNN, an output rounded to
    # bfloat16 (oneDNN's output dtype is its input's), returned as float32 [T, out]
    if not weight.is_mkldnn and weight.dtype != torch.bfloat16:
        weight = weight.to(torch.bfloat16)  # not packed yet (weights still loading)
    out = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weight, None, "none", [], "").to(x.dtype)
    return out if bias is None else out + bias


def _bf16_pack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), None)


# bfloat16 weights in oneDNN's blocked layout, everything else float32: on a CPU with
# AVX512-BF16 (or AMX) the products stream half the bytes (decode: ~3x faster at 4 rows,
# ~2x at 64, 2 threads). Activations are rounded to bfloat16 per row, which is row-wise;
# the brgemm path gave every row the same bits for 1 to 64 rows (tests/model/test_llama.py),
# and rows are padded to 4 like onednn_packed all the same.
ONEDNN_BF16 = MatmulKernel("onednn_bf16", 4, _bf16_linear, _bf16_pack)
PLAIN = MatmulKernel("torch", 1, F.linear)  # GPUs, and CPU runs that opt out of invariance
# Weight-only int8 (per output channel) and int4 (groups of 32) on torch's CPU kernels, bfloat16
# activations (quantize.py). Each row is reduced on its own: every row count 1..1024 gave each row
# the same bits (tests/model/test_llama.py), so no padding.
INT8 = MatmulKernel("int8", 1, quantize.int8_linear, quantize.quantize_int8)
INT4 = MatmulKernel("int4", 1, quantize.int4_linear, quantize.quantize_int4)
# The same int8 weights, float32 scales and activations, on pagoda's own AVX2/FMA kernel
# (pagoda/kernels/cpu_int_matmul.cpp): every output element is one fixed instruction sequence whatever
# the row count, tile or thread, so no padding. `--quantization int8` takes it where it builds.
# It streams about 13 GB/s on one thread; waking the second costs ~0.2 ms on the 2-core CI machine, so
# products under 16M multiply-adds stay on one thread (docs/performance/2026-12-02-cpp-cpu-kernels.md).
INT8_AVX2 = MatmulKernel("int8_avx2", 1, quantize.int8_avx2_linear, quantize.quantize_int8_float_scales,
                         min_parallel_work=16 << 20)

# GGUF-style blocks of 32 weights (Q4_0, Q4_1, Q8_0) on pagoda's integer kernel (pagoda/kernels/cpu_quant_matmul.cpp):
# activations quantized to int8 per row and block, exact integer dots per block and one fixed float sequence per
# output, so every row count, tile, thread split and ISA variant gives the same bits; no padding. A float weight
# packs to Q8_0 (w8a8); a GGUF's own 4-bit blocks are adopted as they are. Waking the second thread (~0.05-0.2 ms)
# pays off above about 24M multiply-adds: the LM head at 1 row, the MLP from 16 rows (docs/kernels.md).
BLOCKS = MatmulKernel("blocks", 1, quantize.block_linear, quantize.block_weight_from_float,
                      min_parallel_work=24 << 20)


def _triton_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    from pagoda.kernels import triton_matmul  # triton loads only where this kernel is chosen

    return triton_matmul.linear(x, weight, bias)


# CUDA with --batch-invariant: a Triton matmul whose tiles and K order never depend on the row count
# (pagoda/kernels/triton_matmul.py), so every row count gives a row the same bits, with no padding.
TRITON_INVARIANT = MatmulKernel("triton_invariant", 1, _triton_linear)
QUANTIZATIONS = ("none", "int8", "int4", "gguf", "w8a8", "auto")  # --quantization
# `auto`: a GGUF file's own blocks (`gguf`) where the model came from one and pagoda's C++ kernels run on this
# CPU, as llama.cpp runs a GGUF; `none` (the float kernels) otherwise (pagoda/model/loader.py resolves it).
# `gguf` and `w8a8` both run BLOCKS: the file's Q4_0/Q4_1/Q8_0 blocks as they are (other tensors rounded to
# Q8_0), or every weight rounded to Q8_0 from a float checkpoint.
BLOCK_QUANTIZATIONS = ("gguf", "w8a8")


def quantized_matmul(quantization: str, device: torch.device | str) -> MatmulKernel | None:
    """The kernel of a `--quantization` value (None for none; `auto` resolved first, see the loader);
    ValueError when the device cannot run it."""
    if quantization not in QUANTIZATIONS or quantization == "auto":
        raise ValueError(f"quantization must be one of {', '.join(q for q in QUANTIZATIONS if q != 'auto')}, "
                         f"got {quantization!r}")
    if quantization == "none":
        return None
    if torch.device(device).type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on the CPU only (pagoda's and torch's CPU kernels); "
                         f"use --device cpu or --quantization none")
    if quantization in BLOCK_QUANTIZATIONS:
        if (why := cpu_native.load()) is not None:
            raise ValueError(f"--quantization {quantization} runs on pagoda's C++ CPU kernels, and {why}")
        return BLOCKS
    if not quantize.has_int_kernels():
        raise ValueError(f"--quantization {quantization}: this torch build lacks the CPU int8/int4 weight kernels")
    if quantization == "int8":
        return INT8_AVX2 if cpu_native.available() else INT8
    return INT4


def select_matmul(device: torch.device | str, dtype: torch.dtype = torch.float32, name: str | None = None) -> MatmulKernel:
    """The matmul kernel for a device: batch-invariant float32 on CPU, torch's own elsewhere."""
    kernels = {k.name: k for k in (ONEDNN_PACKED, ONEDNN, ONEDNN_BF16, MKL_PADDED, PLAIN, INT8, INT4, INT8_AVX2,
                                   BLOCKS, TRITON_INVARIANT)}
    if name is not None:
        if name not in kernels:
            raise ValueError(f"unknown matmul kernel {name!r} (known: {', '.join(kernels)})")
        return kernels[name]
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16 and has_onednn_bf16():
        return ONEDNN_BF16
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return PLAIN
    if not _has_onednn_linear():
        return MKL_PADDED
    return ONEDNN_PACKED if _has_onednn_pack() else ONEDNN


def _has_onednn_linear() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        _onednn_linear(torch.zeros(2, 4), torch.zeros(3, 4), None)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def has_onednn_bf16() -> bool:
    """Whether oneDNN runs bfloat16 products natively here (AVX512-BF16 or AMX) and its pack works."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        _bf16_linear(torch.zeros(4, 4), _bf16_pack(torch.zeros(3, 4)), None)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def _has_onednn_pack() -> bool:
    try:
        _onednn_linear(torch.zeros(4, 4), _onednn_pack(torch.zeros(3, 4)), None)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


class PackedWeight:
    """A weight reordered by its MatmulKernel, redone when the weight changes in place.

    Writes through `.data` bypass the version counter, so code that loads weights that
    way calls `Transformer.pack_weights()` afterwards (the runner does, at start-up).
    """

    def __init__(self, matmul: MatmulKernel) -> None:
        self.matmul = matmul
        self.packed: Tensor | None = None
        self.key: tuple[int, int] | None = None
        self.released = False  # the plain weight was freed: the pack is the only copy
        self.shape: tuple[int, int] | None = None  # [out, in] of the weight, kept when it is released
        # rows one call of the kernel may take, 0 for any: products of more rows run as calls of at most this
        # many, the row count this machine proved row invariant for this shape (pagoda/model/invariance.py)
        self.max_rows = 0

    def pack(self, weight: Tensor, release: bool = False) -> None:
        """Snapshot `weight` in the kernel's layout (no-op for kernels that use it as is).

        With `release` the plain weight's storage is freed afterwards (its parameter becomes an
        empty tensor), so the packed copy does not double the weight memory; it is then final.
        """
        if self.matmul.pack is None or self.released:
            return
        with torch.no_grad():
            self.packed = self.matmul.pack(weight)
        self.shape = tuple(weight.shape)
        self.key = (weight.data_ptr(), weight._version)
        if release:
            weight.data = weight.data.new_empty(0)
            self.released = True

    def adopt(self, packed: Any, weight: Tensor, release: bool = True) -> None:
        """Take a pack made elsewhere (from a GGUF's own blocks): final; the plain weight freed with `release`
        (kept for a tied LM head, whose weight the embedding lookup reads)."""
        self.packed, self.key, self.released = packed, None, True
        self.shape = tuple(weight.shape)
        if release:
            weight.data = weight.data.new_empty(0)

    def clear(self) -> None:
        if self.released:
            raise RuntimeError("the plain weight was released after packing: load the model again")
        self.packed, self.key = None, None

    def operand(self, weight: Tensor) -> Tensor:
        """The tensor to multiply by: the pack when there is one (repacked if stale), else the weight."""
        if self.packed is None:
            return weight
        if not self.released and self.key != (weight.data_ptr(), weight._version):
            self.pack(weight)
        return self.packed

    def product(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """x [T, in] @ weight.T (+ bias) -> [T, out] on the kernel, in calls of at most `max_rows` rows."""
        operand = self.operand(weight)
        if not self.max_rows or x.shape[0] <= self.max_rows:
            return self.matmul.linear(x, operand, bias)
        return torch.cat([self.matmul.linear(part, operand, bias) for part in x.split(self.max_rows)])

    def nbytes(self, weight: Tensor) -> int:
        """Bytes a product reads: the pack's when there is one, else the plain weight's."""
        t = self.packed if self.packed is not None else weight
        return t.numel() * t.element_size() if isinstance(t, Tensor) else t.nbytes


class Linear(nn.Linear):
    """nn.Linear whose product runs on the model's MatmulKernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool, matmul: MatmulKernel, **factory: Any) -> None:
        super().__init__(in_features, out_features, bias=bias, **factory)
        self.matmul = matmul
        self.packed = PackedWeight(matmul)

    def forward(self, x: Tensor) -> Tensor:
        return self.packed.product(x, self.weight, self.bias)
