"""Plain vectorized CPU attention through torch's fused SDPA: fast, but not batch invariant.

Design note. This is the yardstick for what batch invariance costs on the CPU
(see cpu_attention.py): it reads the context with the same gather, then hands
whole decode groups and whole prefill chunks to
`torch.nn.functional.scaled_dot_product_attention`, whose kernels choose their
blocking and reduction order from the shapes they are given. A row's bits then
depend on what else shares the call, so the engine does not select this
backend by default; it exists for throughput comparisons and for users who
trade exact reproducibility for speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagoda.kernels.kv_cache import gather_contexts, write_kv
from pagoda.kernels.metadata import AttentionMetadata
from pagoda.kernels.workspace import Workspace

DECODE_GROUP = 64  # decodes per SDPA call


def sdpa_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    workspace: Workspace | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """q [T, H, D] -> out [T, H, D]; causal paged attention, not batch invariant."""
    ws = workspace or Workspace()
    out = torch.empty_like(q) if out is None else out
    starts = meta.query_starts_cpu
    decodes = sorted((b for b, n in enumerate(meta.query_lens_cpu) if n == 1), key=meta.seq_lens_cpu.__getitem__)
    for i in range(0, len(decodes), DECODE_GROUP):
        seqs = decodes[i : i + DECODE_GROUP]
        lens = [meta.seq_lens_cpu[b] for b in seqs]
        k, v = gather_contexts(k_cache, v_cache, meta.block_tables[seqs], lens, max(lens), ws)  # [N, L, KVH, D]
        tokens = torch.tensor([starts[b] for b in seqs], dtype=torch.int64)
        visible = torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]  # [N, L]
        o = F.scaled_dot_product_attention(
            q[tokens].float().unsqueeze(2),  # [N, H, 1, D]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=visible[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        out[tokens] = o.squeeze(2).to(out.dtype)
    for b, qlen in enumerate(meta.query_lens_cpu):
        if qlen == 1:
            continue
        seq_len = meta.seq_lens_cpu[b]
        k, v = gather_contexts(k_cache, v_cache, meta.block_tables[b : b + 1], [seq_len], seq_len, ws)
        q_pos = torch.arange(seq_len - qlen, seq_len)
        causal = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [qlen, L]
        chunk = q[starts[b] : starts[b] + qlen].float().transpose(0, 1).unsqueeze(0)  # [1, H, qlen, D]
        o = F.scaled_dot_product_attention(
            chunk, k.transpose(1, 2), v.transpose(1, 2), attn_mask=causal, scale=scale, enable_gqa=True
        )
        out[starts[b] : starts[b] + qlen] = o[0].transpose(0, 1).to(out.dtype)
    return out


class SdpaBackend:
    """AttentionBackend over torch SDPA on the CPU; faster, not batch invariant."""

    name = "cpu_sdpa"

    def __init__(self) -> None:
        self.workspace = Workspace()  # gather buffers reused across steps

    def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """Store new K/V through slot_mapping."""
        write_kv(k_cache, v_cache, k, v, slot_mapping)

    def attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
    ) -> Tensor:
        """Causal attention of the new tokens over their cached context."""
        return sdpa_attention(q, k_cache, v_cache, meta, scale, self.workspace)
