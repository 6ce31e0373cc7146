"""Paged attention kernels: the backend protocol, the metadata it reads, and start-up selection.

Backends:
- "triton": Triton kernels, the default on CUDA (triton_decode.py, triton_prefill.py).
- "triton_invariant": the same kernels, every step through the prefill kernel, so a row's bits never depend on
  the batch (triton_backend.py's design note); what `select_backend(..., batch_invariant=True)` gives on CUDA.
- "cpu": bitwise batch invariant, the default on the CPU: pagoda's C++ kernel for float32 on AVX2 CPUs
  (cpu_paged_attention.cpp, through cpu_native.py), else vectorized torch (cpu_plan.py, cpu_attention.py).
- "cpu_sdpa": torch SDPA on the CPU, faster on long prefills but not batch invariant (cpu_sdpa.py).
- "reference": plain per-sequence float64 attention, the oracle for tests (reference.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from pagoda.kernels.kv_cache import allocate_kv_cache, write_kv
from pagoda.kernels.metadata import AttentionMetadata

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BACKEND_NAMES",
    "allocate_kv_cache",
    "select_backend",
    "write_kv",
]


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """Store new K/V [T, KVH, D] into caches [num_blocks, block_size, KVH, D] at slot_mapping [T]."""
        ...

    def attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float, *,
        sliding_window: int = 0, softcap: float = 0.0,
    ) -> Tensor:  # fmt: skip
        """q [T, H, D] -> out [T, H, D]: each sequence's new tokens attend causally to its context.

        sliding_window W > 0: a token at position p sees only keys p - W < k <= p (the last W, itself
        included); 0 means the whole context. softcap c > 0: each scaled score s becomes c * tanh(s / c)
        before masking and softmax; 0 means none. The defaults give plain causal attention, bit for bit.
        """
        ...


def _triton(invariant: bool = False) -> AttentionBackend:
    try:
        from pagoda.kernels.triton_backend import TritonBackend
    except ImportError as exc:  # triton missing or unusable on this machine
        raise ValueError(f"backend 'triton' is unavailable: {exc}") from exc
    return TritonBackend(invariant=invariant)


def _triton_invariant() -> AttentionBackend:
    return _triton(invariant=True)


def _cpu() -> AttentionBackend:
    from pagoda.kernels.cpu_attention import CpuBackend

    return CpuBackend()


def _cpu_sdpa() -> AttentionBackend:
    from pagoda.kernels.cpu_sdpa import SdpaBackend

    return SdpaBackend()


def _reference() -> AttentionBackend:
    from pagoda.kernels.reference import ReferenceBackend

    return ReferenceBackend()


_FACTORIES: dict[str, Callable[[], AttentionBackend]] = {
    "triton": _triton,
    "triton_invariant": _triton_invariant,
    "cpu": _cpu,
    "cpu_sdpa": _cpu_sdpa,
    "reference": _reference,
}
BACKEND_NAMES = tuple(_FACTORIES)


def select_backend(device: torch.device | str, name: str | None = None, *,
                   batch_invariant: bool = False) -> AttentionBackend:
    """Pick the attention backend once at start-up: "triton" on CUDA ("triton_invariant" with `batch_invariant`),
    "cpu" on the CPU (invariant either way), or `name`."""
    device = torch.device(device)
    if name is None:
        name = ("triton_invariant" if batch_invariant else "triton") if device.type == "cuda" else "cpu"
    if name not in _FACTORIES:
        raise ValueError(f"name must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    if name in ("cpu", "cpu_sdpa") and device.type != "cpu":
        raise ValueError(f"backend {name!r} runs on the CPU, not on device {device}")
    return _FACTORIES[name]()
