"""The plain attention every other backend is tested against.

One sequence at a time: read its context from the paged cache, repeat the KV
heads for GQA, take a masked softmax in float64 and cast back. Slow and
obviously correct; it shares only the cache layout with the fast backends.
A sliding window reads only the positions some new token of the sequence can
see, so a test may leave the slots before them unwritten (NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagoda.kernels.kv_cache import gather_positions, write_kv
from pagoda.kernels.metadata import AttentionMetadata


def reference_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: Tensor | None = None,
    *,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """q [T, H, D] -> out [T, H, D]: causal attention over each sequence's cached context.

    sliding_window W > 0: position p sees keys p - W < k <= p. softcap c > 0: a scaled score s becomes
    c * tanh(s / c) before masking and softmax.
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    for b, (start, qlen, seq_len) in enumerate(
        zip(meta.query_starts_cpu, meta.query_lens_cpu, meta.seq_lens_cpu)
    ):
        first = max(0, seq_len - qlen - sliding_window + 1) if sliding_window > 0 else 0  # the earliest key seen
        k = gather_positions(k_cache, meta.block_tables[b], seq_len)[first:].double()  # [L, KVH, D]
        v = gather_positions(v_cache, meta.block_tables[b], seq_len)[first:].double()
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]: query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        qs = q[start : start + qlen].double()  # [qlen, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale  # [H, qlen, L]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
        k_pos = torch.arange(first, seq_len, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # [qlen, L]
        if sliding_window > 0:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + qlen] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


class ReferenceBackend:
    """AttentionBackend built on reference_attention; used by tests as the oracle."""

    name = "reference"

    def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """Store new K/V through slot_mapping."""
        write_kv(k_cache, v_cache, k, v, slot_mapping)

    def attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float, *,
        sliding_window: int = 0, softcap: float = 0.0,
    ) -> Tensor:  # fmt: skip
        """Causal attention of the new tokens over their cached context (windowed, soft-capped if asked)."""
        return reference_attention(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window, softcap=softcap)
