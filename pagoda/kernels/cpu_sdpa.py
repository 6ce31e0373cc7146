"""Plain vectorized CPU attention through torch's fused SDPA: fast, but not batch invariant.

Design note. This is the yardstick for what batch invariance costs on the CPU
(see cpu_attention.py): it reads the context with the same gather, then hands
whole decode groups and whole prefill chunks to
`torch.nn.functional.scaled_dot_product_attention`, whose kernels choose their
blocking and reduction order from the shapes they are given. A row's bits then
depend on what else shares the call, so the engine does not select this
backend by default; it exists for throughput comparisons and for users who
trade exact reproducibility for speed.

A sliding window is one more term of the explicit mask; the gather starts at
the block holding the earliest key a group's rows see, and K/V slots before a
sequence's window start are zeroed like those past its end (they may never
have been written). SDPA cannot soft-cap scores, so with `softcap` the same
gathered context goes through explicit float32 products instead (scores,
c * tanh(s / c), mask, softmax, P @ V), GQA by a view, never repeating K/V.
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
    *,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """q [T, H, D] -> out [T, H, D]; causal paged attention (the last sliding_window keys if > 0, scores
    soft-capped if softcap > 0), not batch invariant."""
    ws = workspace or Workspace()
    out = torch.empty_like(q) if out is None else out
    starts, block_size = meta.query_starts_cpu, k_cache.shape[1]
    decodes = sorted((b for b, n in enumerate(meta.query_lens_cpu) if n == 1), key=meta.seq_lens_cpu.__getitem__)
    for i in range(0, len(decodes), DECODE_GROUP):
        seqs = decodes[i : i + DECODE_GROUP]
        lens = [meta.seq_lens_cpu[b] for b in seqs]
        first = _window_starts([n - 1 for n in lens], sliding_window)  # [N] the first key each decode sees
        start = int(first.min()) // block_size * block_size
        k, v = gather_contexts(k_cache, v_cache, meta.block_tables[seqs], lens, max(lens) - start, ws, start)
        key_pos = torch.arange(start, max(lens))[None, :]
        visible = key_pos < torch.tensor(lens)[:, None]  # [N, L]
        if sliding_window > 0:
            visible &= key_pos >= first[:, None]
            _zero_hidden(k, v, visible)
        tokens = torch.tensor([starts[b] for b in seqs], dtype=torch.int64)
        o = _attend(
            q[tokens].float().unsqueeze(2),  # [N, H, 1, D]
            k.transpose(1, 2),
            v.transpose(1, 2),
            visible[:, None, None, :],
            scale,
            softcap,
        )
        out[tokens] = o.squeeze(2).to(out.dtype)
    for b, qlen in enumerate(meta.query_lens_cpu):
        if qlen == 1:
            continue
        seq_len = meta.seq_lens_cpu[b]
        q_pos = torch.arange(seq_len - qlen, seq_len)
        first = int(_window_starts([seq_len - qlen], sliding_window)[0])  # the chunk's first token sees the earliest
        start = first // block_size * block_size
        k, v = gather_contexts(k_cache, v_cache, meta.block_tables[b : b + 1], [seq_len], seq_len - start, ws, start)
        key_pos = torch.arange(start, seq_len)[None, :]
        causal = key_pos <= q_pos[:, None]  # [qlen, L]
        if sliding_window > 0:
            causal &= key_pos > q_pos[:, None] - sliding_window
            _zero_hidden(k, v, key_pos >= first)
        chunk = q[starts[b] : starts[b] + qlen].float().transpose(0, 1).unsqueeze(0)  # [1, H, qlen, D]
        o = _attend(chunk, k.transpose(1, 2), v.transpose(1, 2), causal, scale, softcap)
        out[starts[b] : starts[b] + qlen] = o[0].transpose(0, 1).to(out.dtype)
    return out


def _window_starts(positions: list[int], window: int) -> Tensor:
    """[N] int64: the first key a token at each position sees (0 without a window)."""
    pos = torch.tensor(positions, dtype=torch.int64)
    return (pos - window + 1).clamp(min=0) if window > 0 else torch.zeros_like(pos)


def _zero_hidden(k: Tensor, v: Tensor, seen: Tensor) -> None:
    """Zero K/V [N, L, KVH, D] where no row looks (seen [N, L] False): slots before a window may hold NaN,
    and a masked NaN score or 0 * NaN would still be NaN."""
    k.masked_fill_(~seen[:, :, None, None], 0.0)
    v.masked_fill_(~seen[:, :, None, None], 0.0)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float) -> Tensor:
    """q [N, H, Lq, D], k/v [N, KVH, L, D], mask (bool, True = seen) broadcast to [N, H, Lq, L] -> [N, H, Lq, D]."""
    if softcap <= 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    n, heads, lq, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    # head h = kv head h // G: the G heads of a kv head are rows of one product with its K
    scores = q.reshape(n, kv_heads, group * lq, dim) @ k.transpose(-1, -2) * scale  # [N, KVH, G * Lq, L]
    scores = (scores / softcap).tanh_().mul_(softcap).view(n, kv_heads, group, lq, -1)
    mask = mask.expand(n, heads, lq, -1).reshape(n, kv_heads, group, lq, -1)
    probs = scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1)
    return (probs.view(n, kv_heads, group * lq, -1) @ v).view(n, heads, lq, dim)


class SdpaBackend:
    """AttentionBackend over torch SDPA on the CPU; faster, not batch invariant."""

    name = "cpu_sdpa"

    def __init__(self) -> None:
        self.workspace = Workspace()  # gather buffers reused across steps

    def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """Store new K/V through slot_mapping."""
        write_kv(k_cache, v_cache, k, v, slot_mapping)

    def attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float, *,
        sliding_window: int = 0, softcap: float = 0.0,
    ) -> Tensor:  # fmt: skip
        """Causal attention of the new tokens over their cached context (windowed, soft-capped if asked)."""
        if sliding_window < 0 or softcap < 0:
            raise ValueError(f"sliding_window and softcap must be >= 0 (0: none), got {sliding_window}, {softcap}")
        return sdpa_attention(q, k_cache, v_cache, meta, scale, self.workspace, sliding_window=sliding_window,
                              softcap=softcap)
