"""The attention backend used on CUDA: Triton kernels behind the AttentionBackend protocol.

A step whose sequences are all decodes runs the split-K decode kernel (fixed
split size, then a reduce); any step with a longer chunk runs the prefill
kernel over every sequence, a decode being a chunk of one token. K/V are
written with one indexed copy: the runner writes them before attention, so
both kernels read every position, new or cached, from the same paged layout.
A sliding window and soft-capping are arguments of both kernels (compile-time
switches: without them the kernels are the plain ones).

Batch invariance. A row's result never depends on the other sequences of the
step inside either kernel, but which kernel runs depends on the whole step: a
decode beside a prefill chunk goes through the prefill kernel, alone through
the split-K decode kernel, and the two agree only to rounding. The invariant
backend (`TritonBackend(invariant=True)`, "triton_invariant") runs the prefill
kernel for every step, so a row's bits depend only on its own sequence: not on
the batch, nor on how its prompt was chunked (its tiles sit at absolute
positions; a tile past a row's position adds exact zeros). What it costs: a
decode loses the split of its context over programs, so few long sequences
keep fewer SMs busy (`pagoda bench kernels` times both).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagoda.kernels.kv_cache import write_kv
from pagoda.kernels.metadata import AttentionMetadata
from pagoda.kernels.triton_decode import decode_attention
from pagoda.kernels.triton_prefill import prefill_attention


class TritonBackend:
    """AttentionBackend over the Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1)."""

    def __init__(self, invariant: bool = False) -> None:
        self.invariant = invariant  # every step through the prefill kernel (the design note)
        self.name = "triton_invariant" if invariant else "triton"

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
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("k_cache and v_cache must be contiguous in head_dim")
        out = torch.empty_like(q)
        if meta.num_tokens == 0:
            return out
        if meta.max_query_len == 1 and not self.invariant:
            return decode_attention(q, k_cache, v_cache, meta, scale, out, sliding_window, softcap)
        return prefill_attention(q, k_cache, v_cache, meta, scale, out, sliding_window, softcap)
