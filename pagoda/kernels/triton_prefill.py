"""Paged prefill/extend attention in Triton: a chunk of new tokens over its cached prefix plus itself.

Design note. One program handles BLOCK_Q consecutive new tokens of one
sequence for one kv head. Its q tile has BLOCK_Q * GROUP_PAD rows: row r is
token r // GROUP_PAD of the block and query head kv_head * G + r % GROUP_PAD,
so each K/V tile is loaded once for all G heads that share it (GQA without
repeating K/V). The program walks the keys from position 0 up to its last
token in tiles of TILE_N positions, in ascending order, with an online softmax
in base 2; keys after a row's own position are masked, and since a row always
sees position 0 its running max is finite after the first tile, so a tile
entirely in its future is an exact no-op (alpha = 1, nothing added).

This covers plain prefill (no cached prefix), chunked prefill and recompute
after preemption (a cached prefix read through the block table), and mixed
batches, where a decode is simply a chunk of one token. Tiles sit at the same
absolute positions as in the decode kernel, so both walk a context in the same
order; only the decode kernel's split-and-reduce differs.

A sliding window W (`WINDOW`) hides keys at or before a row's position - W:
the walk starts at the tile holding the block's earliest window start (no
key before it is loaded), and since a row may then see nothing in its first
tiles, its running max may stay -inf: the fold subtracts 0 there (`SAFE`).
Soft-capping (`SOFTCAP`) is applied to the scores before the mask, as in decode.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from pagoda.kernels.metadata import AttentionMetadata
from pagoda.kernels.triton_decode import TILE_N, dot_precision, fold_tile, score_scales

BLOCK_M = 64  # q rows per program: tokens x padded group; keys in tiles of TILE_N, as in decode


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, q_start_ptr,
    qk_scale, softcap_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kp, stride_kh,
    stride_vb, stride_vp, stride_vh,
    stride_tb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)
    q_start = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        first_pos = seq_len - q_len  # position of the first new token
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        q_idx = q_block * BLOCK_Q + rows // GROUP_PAD  # new-token index within the sequence
        g = rows % GROUP_PAD
        row_ok = (q_idx < q_len) & (g < GROUP)
        q_pos = first_pos + q_idx  # [BLOCK_M] absolute positions
        tokens = (q_start + q_idx).to(tl.int64)
        heads = kv_head * GROUP + g
        offs_d = tl.arange(0, DIM_PAD)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, DIM_PAD]
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], tl.float32)
        end = tl.minimum(seq_len, first_pos + (q_block + 1) * BLOCK_Q)  # one past the block's last position
        lo = 0  # the first key the block's first token (the earliest window) sees
        first = 0
        if WINDOW:
            lo = tl.maximum(first_pos + q_block * BLOCK_Q - window + 1, 0)
            first = lo // TILE * TILE
        for start in range(first, end, TILE):
            pos = start + tl.arange(0, TILE)
            p_ok = pos < end
            keep = p_ok[None, :] & (pos[None, :] <= q_pos[:, None])  # causal
            if WINDOW:
                p_ok = p_ok & (pos >= lo)
                keep = keep & p_ok[None, :] & (pos[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = fold_tile(
                q, m_i, l_i, acc, pos, p_ok, keep, seq, kv_head, offs_d, d_ok, qk_scale, softcap_log2,
                k_ptr, v_ptr, tables_ptr, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, stride_tb,
                BLOCK_SIZE, PRECISION, SOFTCAP, WINDOW,
            )  # fmt: skip
        if WINDOW:  # a padding row past the chunk may see nothing: 0 / 1, not 0 / 0 (it is not stored)
            l_i = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


def prefill_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float, out: Tensor,
    sliding_window: int = 0, softcap: float = 0.0,
) -> Tensor:  # fmt: skip
    """Any mix of chunks and decodes: q/out [T, H, D], caches [N, bs, KVH, D]; the last sliding_window keys
    if > 0, scores soft-capped if softcap > 0."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, BLOCK_M // group_pad)
    grid = (meta.num_seqs, num_kv_heads, triton.cdiv(meta.max_query_len, block_q))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        *score_scales(scale, softcap), sliding_window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, TILE=TILE_N, PRECISION=dot_precision(q),
        WINDOW=sliding_window > 0, SOFTCAP=softcap > 0,
    )  # fmt: skip
    return out
