"""Batch-invariant linear layers in Triton: a row's bits never depend on the other rows of the product.

Design note. cuBLAS picks its algorithm, tile shape and split-K from the whole
problem's shape, the row count included, so one row's result can change with
the batch it sits in (a decode alone against the same decode among 63 others).
Here the configuration (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) is
a function of the weight's shape and dtype alone (`config_for`), never of the
row count: program (m, n, s) multiplies rows [m*BM, (m+1)*BM) by output
columns [n*BN, (n+1)*BN) over split s's range of K, walking it in BLOCK_K
steps in ascending order into a float32 accumulator. With SPLIT_K > 1 each
split writes a float32 partial and a second kernel adds the partials in split
order (then the bias, then rounds to the output dtype). So every output element
is one fixed sequence of tensor-core products and float32 additions, whatever
the row count and wherever the row falls in its tile (rows past the end load
as zeros and are never stored).

Split-K is there for the few-row products of decoding: a [64, 4096] x
[4096, 4096] product has only 64 column tiles, too few programs to keep an
H200's 132 SMs reading weights. Its split count follows from the number of
column tiles (`TARGET_PROGRAMS`), so it too is fixed per weight shape.

float32 inputs use input_precision="ieee" (no TF32), as the attention kernels do;
`reference_linear` beside it is the plain float64 product the tests compare with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

TARGET_PROGRAMS = 264  # column tiles x splits to aim for: two programs per SM of an H200 (132 SMs)
MAX_SPLIT_K = 8


@dataclass(frozen=True)
class MatmulConfig:
    """One product's tiling: fixed per weight shape and dtype, so a row's arithmetic never changes with the batch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def config_for(out_features: int, in_features: int, dtype: torch.dtype) -> MatmulConfig:
    """The configuration of a weight [out, in]: a function of its shape and dtype only (never the row count)."""
    wide = dtype != torch.float32  # 16-bit operands: twice the K per tile in the same shared memory
    block_m, block_n, block_k = 64, 64, (128 if wide else 32)
    tiles_n = triton.cdiv(out_features, block_n)
    steps_k = triton.cdiv(in_features, block_k)
    split = max(1, min(MAX_SPLIT_K, triton.cdiv(TARGET_PROGRAMS, tiles_n), steps_k // 4))
    return MatmulConfig(block_m, block_n, block_k, split, num_warps=4, num_stages=4 if wide else 2)


def _k_per_split(in_features: int, config: MatmulConfig) -> int:
    """Inputs per split, a whole number of BLOCK_K steps (the last split may be shorter)."""
    return triton.cdiv(triton.cdiv(in_features, config.split_k), config.block_k) * config.block_k


# M, the row count, is never specialized on (Triton compiles a separate kernel for an argument equal to 1 or a
# multiple of 16): one compiled kernel for every row count, as the design note requires
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):  # ascending, whatever the row count
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:  # a float32 partial [SPLIT_K, M, N], added in split order by _reduce_kernel
        part = part_ptr + pid_s.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, stride_om,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # split order
        acc += tl.load(part_ptr + s * M * N + row * N + offs_n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


REDUCE_BLOCK = 1024


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, config: MatmulConfig | None = None) -> Tensor:
    """x [..., in] @ weight[out, in]^T (+ bias [out]) -> [..., out] in x's dtype, each row batch invariant.

    `config` overrides `config_for` (benchmarks compare tilings; the engine never passes one)."""
    assert x.shape[-1] == weight.shape[1], (x.shape, weight.shape)
    assert x.dtype == weight.dtype, (x.dtype, weight.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    (m, k), n = x2.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    cfg = config or config_for(n, k, weight.dtype)
    has_bias = bias is not None
    part = out if cfg.split_k == 1 else torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _matmul_kernel[grid](
        x2, weight, bias if has_bias else out, out, part,
        m, n, k, _k_per_split(k, cfg),
        x2.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        HAS_BIAS=has_bias, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if cfg.split_k > 1:
        _reduce_kernel[(m, triton.cdiv(n, REDUCE_BLOCK))](
            part, bias if has_bias else out, out, m, n, out.stride(0),
            SPLIT_K=cfg.split_k, HAS_BIAS=has_bias, BLOCK=REDUCE_BLOCK,
        )  # fmt: skip
    return out.view(*lead, n)


def reference_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The plain product in float64, rounded to x's dtype once: what `linear` is tested against."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
