"""Split-K paged decode attention in Triton: one query token per sequence over its whole context.

Design note. Decode is bound by reading the KV cache, and one program per
(sequence, kv head) leaves most of the GPU idle when the batch is small and
the context long. So the context is cut into splits of a FIXED size
(SPLIT_SIZE positions, not a fixed number of splits): program (b, h, s) reads
positions [s*SPLIT_SIZE, (s+1)*SPLIT_SIZE) of sequence b in tiles of TILE_N
positions, in ascending order, with an online softmax, and writes a partial
(max, sum, weighted V) per query head. A second kernel folds the partials of
each (sequence, head) in split order. Because the split size never depends on
the batch, a sequence's arithmetic is the same alone or in a crowd.

GQA lives in the kernel: a program loads each K/V tile once for all G query
heads of its kv head (rows of the q tile, padded to 16 for tl.dot); K/V heads
are never repeated in memory. Scores are kept in base 2 (scale * log2 e) so the
softmax uses exp2. Cache addresses come from the block table per position, so
any block size works and TILE_N need not divide it.

A sliding window W (`WINDOW`) starts the walk at the tile holding the first
key the token sees (seq_len - W): splits wholly before it do nothing, the
reduce starts at its split, and no key before it is loaded. Soft-capping c
(`SOFTCAP`) turns a score s into c * tanh(s / c) (tanh from exp2, which the
interpreter also runs) before the mask; both are compile-time switches, so a
kernel without them is the plain one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagoda.kernels.metadata import AttentionMetadata

SPLIT_SIZE = 512  # positions per split: fixed, so the partition never depends on the batch
TILE_N = 32  # positions per tile inside a split; divides SPLIT_SIZE
LOG2E = 1.4426950408889634


def dot_precision(q: Tensor) -> str:
    """Full float32 products for float32 inputs (no TF32); 16-bit inputs keep the default."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def score_scales(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, softcap_log2) for the kernels: scores in base 2 are dot * qk_scale, or with soft-capping c
    softcap_log2 * tanh(dot * qk_scale) = c * tanh(dot * scale / c) * log2 e."""
    if softcap > 0:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0


@triton.jit
def _tanh(x):
    """tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) <= 1: no overflow, exact sign."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 log2(e)
    y = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -y, y)


@triton.jit
def fold_tile(
    q, m_i, l_i, acc, pos, p_ok, keep, seq, kv_head, offs_d, d_ok, qk_scale, softcap_log2,
    k_ptr, v_ptr, tables_ptr, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, stride_tb,
    BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, SAFE: tl.constexpr,
):  # fmt: skip
    """Fold one tile of keys (positions `pos`, valid where `p_ok`, seen where `keep`) into the online softmax.

    Decode and prefill both call this, so a row's keys are read and reduced the same way on either path.
    q [R, DIM_PAD]; m_i, l_i [R]; acc [R, DIM_PAD]; keep [R, TILE]. Returns the new (m_i, l_i, acc).
    SAFE: a row may have seen no key yet (a sliding window), so a max of -inf subtracts 0 instead (no NaN).
    """
    block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=p_ok, other=0).to(tl.int64)
    offset = pos % BLOCK_SIZE
    kv_mask = p_ok[:, None] & d_ok[None, :]
    k = tl.load(
        k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_kp + kv_head * stride_kh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )  # [TILE, DIM_PAD]
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [R, TILE], base 2 unless soft-capped
    if SOFTCAP:
        s = softcap_log2 * _tanh(s)
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite for every row with a seen position so far
    m_sub = m_new
    if SAFE:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(
        v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vp + kv_head * stride_vh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )  # [TILE, DIM_PAD]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, q_start_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    qk_scale, softcap_log2, window,
    stride_qt, stride_qh,
    stride_kb, stride_kp, stride_kh,
    stride_vb, stride_vp, stride_vh,
    stride_tb,
    stride_pb, stride_ph, stride_ps,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_start = split * SPLIT
    lo = 0  # the first key the token sees
    if WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    if (split_start < seq_len) & (split_start + SPLIT > lo):
        split_end = tl.minimum(split_start + SPLIT, seq_len)
        first = split_start  # tiles at absolute multiples of TILE, from the one holding lo
        if WINDOW:
            first = tl.maximum(split_start, lo // TILE * TILE)
        token = tl.load(q_start_ptr + seq).to(tl.int64)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, DIM_PAD)
        heads = kv_head * GROUP + offs_g
        g_ok = offs_g < GROUP
        d_ok = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [GROUP_PAD, DIM_PAD]
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        for start in range(first, split_end, TILE):
            pos = start + tl.arange(0, TILE)
            p_ok = pos < split_end
            if WINDOW:
                p_ok = p_ok & (pos >= lo)
            # every tile holds a key the token sees: its max is finite from the first one (no SAFE)
            m_i, l_i, acc = fold_tile(
                q, m_i, l_i, acc, pos, p_ok, p_ok[None, :], seq, kv_head, offs_d, d_ok, qk_scale, softcap_log2,
                k_ptr, v_ptr, tables_ptr, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, stride_tb,
                BLOCK_SIZE, PRECISION, SOFTCAP, False,
            )  # fmt: skip
        part = seq * stride_pb + heads * stride_ph + split * stride_ps  # [GROUP_PAD]
        tl.store(part_m_ptr + part, m_i, mask=g_ok)
        tl.store(part_l_ptr + part, l_i, mask=g_ok)
        tl.store(part_acc_ptr + part[:, None] * DIM_PAD + offs_d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, seq_lens_ptr, q_start_ptr,
    window,
    stride_ot, stride_oh,
    stride_pb, stride_ph, stride_ps,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLIT: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_splits = tl.cdiv(seq_len, SPLIT)
    first = 0  # the split holding the first key the token sees: earlier ones wrote nothing
    if WINDOW:
        first = tl.maximum(seq_len - window, 0) // SPLIT
    offs_d = tl.arange(0, DIM_PAD)
    base = seq * stride_pb + head * stride_ph
    m_i = tl.load(part_m_ptr + base + first * stride_ps)
    l_i = tl.load(part_l_ptr + base + first * stride_ps)
    acc = tl.load(part_acc_ptr + (base + first * stride_ps) * DIM_PAD + offs_d)
    for s in range(first + 1, num_splits):  # split order, whatever the batch
        m_s = tl.load(part_m_ptr + base + s * stride_ps)
        l_s = tl.load(part_l_ptr + base + s * stride_ps)
        acc_s = tl.load(part_acc_ptr + (base + s * stride_ps) * DIM_PAD + offs_d)
        m_new = tl.maximum(m_i, m_s)
        a_old = tl.exp2(m_i - m_new)
        a_new = tl.exp2(m_s - m_new)
        l_i = l_i * a_old + l_s * a_new
        acc = acc * a_old + acc_s * a_new
        m_i = m_new
    token = tl.load(q_start_ptr + seq).to(tl.int64)
    out = acc / l_i
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)  # fmt: skip


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float, out: Tensor,
    sliding_window: int = 0, softcap: float = 0.0, *, split_size: int = SPLIT_SIZE, tile: int = TILE_N,
    num_warps: int = 4, num_stages: int = 3,
) -> Tensor:  # fmt: skip
    """Decode rows only (every query_len is 1): q/out [B, H, D], caches [N, bs, KVH, D]; the last
    sliding_window keys if > 0, scores soft-capped if softcap > 0. The split, tile, warps and stages are
    the engine's fixed ones; `pagoda bench kernels --sweep` varies them (a tile of other size changes
    the order of the sums, so the bits, but never with the batch)."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    dim_pad = triton.next_power_of_2(head_dim)
    max_splits = triton.cdiv(meta.max_seq_len, split_size)
    part_acc = torch.empty((num_seqs, num_heads, max_splits, dim_pad), dtype=torch.float32, device=q.device)
    part_m = torch.empty((num_seqs, num_heads, max_splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    _decode_split_kernel[(num_seqs, num_kv_heads, max_splits)](
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        part_acc, part_m, part_l,
        *score_scales(scale, softcap), sliding_window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0),
        part_m.stride(0), part_m.stride(1), part_m.stride(2),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, TILE=tile, SPLIT=split_size, PRECISION=dot_precision(q),
        WINDOW=sliding_window > 0, SOFTCAP=softcap > 0, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _decode_reduce_kernel[(num_seqs, num_heads)](
        out, part_acc, part_m, part_l, meta.seq_lens, meta.query_start_loc,
        sliding_window,
        out.stride(0), out.stride(1),
        part_m.stride(0), part_m.stride(1), part_m.stride(2),
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, SPLIT=split_size, WINDOW=sliding_window > 0,
    )  # fmt: skip
    return out
