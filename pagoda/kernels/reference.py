"""The plain attention every other backend is tested against.

One sequence at a time: read its whole context from the paged cache, repeat
the KV heads for GQA, take a masked softmax in float64 and cast back. Slow and
obviously correct; it shares only the cache layout with the fast backends.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagoda.kernels.kv_cache import gather_positions, write_kv
from pagoda.kernels.metadata import AttentionMetadata


def reference_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float, out: Tensor | None = None
) -> Tensor:
    """q [T, H, D] -> out [T, H, D]: causal attention over each sequence's cached context."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    for b, (start, qlen, seq_len) in enumerate(
        zip(meta.query_starts_cpu, meta.query_lens_cpu, meta.seq_lens_cpu)
    ):
        k = gather_positions(k_cache, meta.block_tables[b], seq_len).double()  # [L, KVH, D]
        v = gather_positions(v_cache, meta.block_tables[b], seq_len).double()
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]: query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        qs = q[start : start + qlen].double()  # [qlen, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale  # [H, qlen, L]
        q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        causal = k_pos[None, :] <= q_pos[:, None]  # [qlen, L]
        scores = scores.masked_fill(~causal, float("-inf"))
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
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
    ) -> Tensor:
        """Causal attention of the new tokens over their cached context."""
        return reference_attention(q, k_cache, v_cache, meta, scale)
