"""Weight-only int8 and int4 formats for the CPU: quantize, pack, dequantize, multiply.

Design note. Decoding a small model on a CPU streams every weight once per step, so fewer weight
bytes are a faster step while the rows are few. Two formats, each torch's own CPU kernel:

- int8, per output channel: w[n, k] = q[n, k] * scale[n], q in -127..127 (symmetric round to nearest).
  `aten._weight_int8pack_mm(x [T, K], q [N, K] int8, scale [N])`.
- int4, per group of 32 inputs: w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g], q in 0..15
  (asymmetric round to nearest between the group's min and max).
  `aten._weight_int4pack_mm_for_cpu(x [T, K], packed [N, K/2] uint8, 32, scales_zeros [K/32, N, 2])`.

pagoda's own AVX2 kernel (`pagoda/kernels/cpu_int_matmul.cpp`, `int8_avx2_linear`) multiplies the same int8
weights with float32 scales, activations and accumulation, at the memory bandwidth for a decode's few rows.

torch's kernels want the activations, scales and zeros in one dtype: bfloat16 (float32 activations take
those kernels' scalar path, 10-60x slower; float16 is slower still). Activations are rounded to
bfloat16 per row and the kernels reduce each row on its own, so a row's bits do not depend on the
other rows at any row count (tests/model/test_llama.py). A GGUF Q4_1 block (w = d * q + m, per 32
weights) is the int4 format with scale = d and zero = m + 8 d, and a Q4_0 block (w = d * (q - 8)) is
scale = d and zero = 0: `int4_from_gguf_blocks` packs those blocks without a second rounding of q
(the scales themselves are rounded to bfloat16).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pagoda.kernels import cpu_native

GROUP_SIZE = 32  # int4 inputs per scale and zero; Q4_1's block size too
Q4_1_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of 32 nibbles (weights 0-15 low, 16-31 high)
Q4_0_BLOCK_BYTES = 18  # float16 d, 16 bytes of 32 nibbles
ACTIVATION_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Int8Weight:
    """int8 weights with one scale per output channel."""

    qweight: Tensor  # [N, K] int8
    scales: Tensor  # [N] bfloat16

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


@dataclass(frozen=True)
class Int4Weight:
    """4-bit weights in torch's CPU packing, with a scale and a zero per group of GROUP_SIZE inputs."""

    packed: Tensor  # [N, K/2] uint8 (aten._convert_weight_to_int4pack_for_cpu)
    scales_zeros: Tensor  # [K/G, N, 2] bfloat16: (scale, zero)
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


def quantize_int8(weight: Tensor, scale_dtype: torch.dtype = ACTIVATION_DTYPE) -> Int8Weight:
    """weight [N, K] float -> int8 per output channel, rounded to nearest (symmetric), scales in `scale_dtype`."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(scale_dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.contiguous())


def quantize_int4(weight: Tensor, group_size: int = GROUP_SIZE) -> Int4Weight:
    """weight [N, K] float -> int4 per group of inputs, rounded to nearest between the group's min and max."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4 needs the input size ({k}) to be a multiple of {group_size}")
    if n % 16:
        raise ValueError(f"int4 needs the output size ({n}) to be a multiple of 16 (torch's CPU packing)")
    w = weight.detach().float().reshape(n, k // group_size, group_size)  # [N, K/G, G]
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(ACTIVATION_DTYPE).float()
    zero = (lo + 8 * scale).to(ACTIVATION_DTYPE).float()  # stored rounded: quantize against what is stored
    q = torch.round((w - zero[..., None]) / scale[..., None] + 8).clamp(0, 15)
    return _pack_int4(q.reshape(n, k), scale, zero)


def int4_from_q4_1(blocks: Tensor) -> Int4Weight:
    """GGUF Q4_1 blocks [N, K/32, 20] uint8 (rows in torch order) -> the int4 pack of the same q."""
    assert blocks.shape[-1] == Q4_1_BLOCK_BYTES, blocks.shape
    return _pack_int4(*int4_parts(blocks))


def int4_from_gguf_blocks(parts: Sequence[Tensor]) -> Int4Weight:
    """GGUF Q4_0 or Q4_1 blocks [N_i, K/32, 18 or 20] uint8, stacked by rows (each part its own type) -> one pack."""
    qs, scales, zeros = zip(*(int4_parts(b) for b in parts))
    return _pack_int4(torch.cat(qs), torch.cat(scales), torch.cat(zeros))


def int4_parts(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(q [N, K] in 0..15, scale [N, K/32], zero [N, K/32]) of GGUF Q4_0 or Q4_1 blocks [N, K/32, 18 or 20]."""
    n, groups, size = blocks.shape
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]  # [N, K/32]
    if size == Q4_1_BLOCK_BYTES:  # w = d * q + m = (q - 8) * d + (m + 8 d)
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        zero = m + 8 * d
    elif size == Q4_0_BLOCK_BYTES:  # w = d * (q - 8)
        zero = torch.zeros_like(d)
    else:
        raise ValueError(f"GGUF 4-bit blocks of {size} bytes are neither Q4_0 ({Q4_0_BLOCK_BYTES}) nor Q4_1 "
                         f"({Q4_1_BLOCK_BYTES})")
    qs = blocks[..., size - 16:].to(torch.int32)  # [N, K/32, 16]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [N, K/32, 32]: weights 0-15 then 16-31
    return q.reshape(n, groups * GROUP_SIZE), d, zero


def _pack_int4(q: Tensor, scale: Tensor, zero: Tensor) -> Int4Weight:
    # q [N, K] in 0..15; scale, zero [N, K/G] -> torch's layout, scales_zeros [K/G, N, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(ACTIVATION_DTYPE).contiguous()
    return Int4Weight(packed, scales_zeros, q.shape[1])


def dequantize(weight: Int8Weight | Int4Weight | BlockWeight) -> Tensor:
    """The float32 weight [N, K] a pack multiplies by (to check a pack, not on the serving path)."""
    if isinstance(weight, BlockWeight):  # the gguf package's dequantization, to the bit
        q, d, m = block_values(weight)
        d, m = d.repeat_interleave(GROUP_SIZE, dim=1), m.repeat_interleave(GROUP_SIZE, dim=1)
        if weight.format == "q4_1":
            return d * q + m
        return d * (q - 8) if weight.format == "q4_0" else q * d
    if isinstance(weight, Int8Weight):
        return weight.qweight.float() * weight.scales.float()[:, None]
    sz = weight.scales_zeros.float()  # [K/G, N, 2]
    scale = sz[..., 0].t().repeat_interleave(GROUP_SIZE, dim=1)  # [N, K]
    zero = sz[..., 1].t().repeat_interleave(GROUP_SIZE, dim=1)
    return (int4_values(weight) - 8) * scale + zero


def int4_values(weight: Int4Weight) -> Tensor:
    """The q in 0..15 of an int4 pack, as float32 [N, K]."""
    # x = I with scale 1 and zero 8 makes the kernel return q itself ([K, N]: small integers, exact in bfloat16)
    eye = torch.eye(weight.in_features, dtype=ACTIVATION_DTYPE)
    q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, weight.packed, GROUP_SIZE, _unit_scales(weight.scales_zeros))
    return q.float().t()


def _unit_scales(scales_zeros: Tensor) -> Tensor:
    # scale 1, zero 8: the kernel then returns q itself (small integers, exact in bfloat16)
    unit = torch.empty_like(scales_zeros)
    unit[..., 0], unit[..., 1] = 1, 8
    return unit


def int8_linear(x: Tensor, weight: Int8Weight | Tensor, bias: Tensor | None) -> Tensor:
    """x [T, K] float32 -> [T, N] float32 through the int8 kernel (bfloat16 activations and output)."""
    if isinstance(weight, Tensor):
        weight = quantize_int8(weight)  # not packed yet (weights still loading)
    out = torch.ops.aten._weight_int8pack_mm(x.to(ACTIVATION_DTYPE), weight.qweight, weight.scales).to(x.dtype)
    return out if bias is None else out + bias


def quantize_int8_float_scales(weight: Tensor) -> Int8Weight:
    """int8 per output channel with float32 scales: the pack of pagoda's own kernel (cpu_native)."""
    if weight.shape[1] % 8:
        raise ValueError(f"int8 needs the input size ({weight.shape[1]}) to be a multiple of 8 (pagoda's AVX2 kernel)")
    return quantize_int8(weight, torch.float32)


def int8_avx2_linear(x: Tensor, weight: Int8Weight | Tensor, bias: Tensor | None) -> Tensor:
    """x [T, K] float32 -> [T, N] float32 through pagoda's AVX2 int8 kernel: float32 activations and output."""
    if isinstance(weight, Tensor):
        weight = quantize_int8_float_scales(weight)
    out = cpu_native.int8_linear(x, weight.qweight, weight.scales)
    return out if bias is None else out + bias


def int4_linear(x: Tensor, weight: Int4Weight | Tensor, bias: Tensor | None) -> Tensor:
    """x [T, K] float32 -> [T, N] float32 through the int4 kernel (bfloat16 activations and output)."""
    if isinstance(weight, Tensor):
        weight = quantize_int4(weight)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(ACTIVATION_DTYPE), weight.packed, GROUP_SIZE,
                                                     weight.scales_zeros).to(x.dtype)
    return out if bias is None else out + bias


# GGUF blocks of 32 weights for pagoda's integer block products (pagoda/kernels/cpu_quant_matmul.cpp, layout and
# arithmetic in cpu_quant.h): the file's blocks, repacked once into 16-column groups with float32 scales.
BLOCK_FORMATS = {"q4_0": 0, "q4_1": 1, "q8_0": 2}  # name -> the kernel's format code
BLOCK_BYTES = {"q4_0": Q4_0_BLOCK_BYTES, "q4_1": Q4_1_BLOCK_BYTES, "q8_0": 34}  # one GGUF block
BLOCK_COLUMNS = 16  # output columns a packed group interleaves


@dataclass(frozen=True)
class BlockWeight:
    """A Q4_0 / Q4_1 / Q8_0 weight [N, K] in the block products' packed layout (cpu_quant.h)."""

    format: str  # "q4_0", "q4_1" or "q8_0"
    qs: Tensor  # [ceil(N/16), K/32, 256 (4-bit) or 512 (8-bit)] uint8
    d: Tensor  # [ceil(N/16), K/32, 16] float32
    m: Tensor  # [ceil(N/16), K/32, 16] float32 for q4_1, else empty
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes + self.m.nbytes


def block_weight_from_gguf(blocks: Tensor, fmt: str) -> BlockWeight:
    """GGUF blocks [N, K/32, 18 (q4_0), 20 (q4_1) or 34 (q8_0)] uint8, rows in torch order -> the packed weight."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"block format must be one of {', '.join(BLOCK_FORMATS)}, got {fmt!r}")
    n, kb, size = blocks.shape
    if size != BLOCK_BYTES[fmt]:
        raise ValueError(f"{fmt} blocks have {BLOCK_BYTES[fmt]} bytes, not {size}")
    groups, pad = -(-n // BLOCK_COLUMNS), -n % BLOCK_COLUMNS
    blocks = torch.nn.functional.pad(blocks, (0, 0, 0, 0, 0, pad))  # zero columns: d = 0, m = 0

    def scales(offset: int) -> Tensor:  # float16 at byte `offset` of each block -> [G, K/32, 16] float32
        f = blocks[..., offset:offset + 2].contiguous().view(torch.float16).float()[..., 0]  # [N', K/32]
        return f.reshape(groups, BLOCK_COLUMNS, kb).transpose(1, 2).contiguous()

    if fmt == "q8_0":
        q = blocks[..., 2:]  # [N', K/32, 32] int8 bits
    else:
        nibbles = blocks[..., size - 16:]  # byte i: weight i (low nibble), weight i + 16 (high)
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # [N', K/32, 32] in 0..15
    # [G, 16 columns, K/32, 8 quads, 4] -> [G, K/32, 8 quads, 16 columns, 4]
    q = q.reshape(groups, BLOCK_COLUMNS, kb, 8, 4).permute(0, 2, 3, 1, 4)
    if fmt != "q8_0":
        q = q[:, :, :4] | (q[:, :, 4:] << 4)  # quads j and j + 4 share chunk j, low and high nibbles
    qs = q.reshape(groups, kb, -1).contiguous()
    m = scales(2) if fmt == "q4_1" else torch.empty(0)
    return BlockWeight(fmt, qs, scales(0), m, n, kb * GROUP_SIZE)


def block_weight_from_float(weight: Tensor, fmt: str = "q8_0") -> BlockWeight:
    """weight [N, K] float -> blocks of 32 rounded as the gguf package's (and llama.cpp's) reference quantizers
    round them (float32 arithmetic, the scales stored as float16), packed for the block products."""
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise ValueError(f"{fmt} needs the input size ({k}) to be a multiple of {GROUP_SIZE}")
    w = weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)

    def inverse(d: Tensor) -> Tensor:
        return torch.where(d == 0, torch.zeros_like(d), 1 / d)

    def half_bytes(d: Tensor) -> Tensor:
        return d.to(torch.float16).view(torch.uint8)  # [N, K/32, 2]

    if fmt == "q8_0":
        d = w.abs().amax(dim=-1, keepdim=True) / 127
        a = (w * inverse(d)).abs()  # round half away from zero, as gguf.quants.np_roundf
        floored = a.floor()
        q = torch.sign(w) * (floored + (2 * (a - floored)).floor())
        blocks = torch.cat([half_bytes(d), q.to(torch.int8).view(torch.uint8)], dim=-1)
    elif fmt == "q4_0":
        d = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)) / -8
        q = torch.trunc(w * inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
        blocks = torch.cat([half_bytes(d), q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    elif fmt == "q4_1":
        lo = w.amin(dim=-1, keepdim=True)
        d = (w.amax(dim=-1, keepdim=True) - lo) / 15
        q = torch.trunc((w - lo) * inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
        blocks = torch.cat([half_bytes(d), half_bytes(lo), q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    else:
        raise ValueError(f"block format must be one of {', '.join(BLOCK_FORMATS)}, got {fmt!r}")
    return block_weight_from_gguf(blocks, fmt)


def block_values(weight: BlockWeight) -> tuple[Tensor, Tensor, Tensor]:
    """(q [N, K] float32: 0..15, or -128..127 for q8_0; d [N, K/32]; m [N, K/32], zeros but for q4_1) of a pack."""
    groups, kb, _ = weight.qs.shape
    q = weight.qs.reshape(groups, kb, -1, BLOCK_COLUMNS, 4)  # [G, K/32, chunks, 16, 4]
    if weight.format == "q8_0":
        q = q.view(torch.int8)
    else:
        q = torch.cat([q & 0x0F, q >> 4], dim=2)  # [G, K/32, 8 quads, 16, 4]
    q = q.permute(0, 3, 1, 2, 4).reshape(groups * BLOCK_COLUMNS, kb * GROUP_SIZE)[:weight.out_features].float()

    def per_column(t: Tensor) -> Tensor:  # [G, K/32, 16] -> [N, K/32]
        return t.transpose(1, 2).reshape(groups * BLOCK_COLUMNS, kb)[:weight.out_features]

    d = per_column(weight.d)
    m = per_column(weight.m) if weight.format == "q4_1" else torch.zeros_like(d)
    return q, d, m


def block_linear(x: Tensor, weight: BlockWeight | Tensor, bias: Tensor | None) -> Tensor:
    """x [T, K] float32 -> [T, N] float32 through pagoda's integer block products (int8 activations per block of
    32, float32 output); a plain weight is quantized to q8_0 first."""
    if isinstance(weight, Tensor):
        weight = block_weight_from_float(weight, "q8_0")  # not packed yet (weights still loading)
    out = cpu_native.block_linear(x, weight.qs, weight.d, weight.m, BLOCK_FORMATS[weight.format], weight.out_features)
    return out if bias is None else out + bias


def has_int_kernels() -> bool:
    """Whether this torch build runs the CPU int8 and int4 weight kernels."""
    try:
        x = torch.zeros(1, GROUP_SIZE)
        int8_linear(x, torch.zeros(16, GROUP_SIZE), None)
        int4_linear(x, torch.zeros(16, GROUP_SIZE), None)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True
