"""Reusable scratch tensors for the CPU kernels.

Freshly allocated multi-megabyte tensors cost page faults on every step (the
allocator hands large blocks back to the OS), which measured several times
the cost of the copy itself. A backend owns one Workspace and asks it for
named buffers; each is grown when too small and otherwise reused, so a
buffer's contents live only until the next request for the same name.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class Workspace:
    """Named scratch buffers, grown on demand and reused across calls (not thread safe)."""

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
        """A contiguous tensor of `shape` backed by the buffer `name`; contents are undefined."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Drop every buffer."""
        self._buffers.clear()
