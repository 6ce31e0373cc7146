"""How the model multiplies: the matmul kernels, their weight packing, and the Linear layer over them.

Design note. Batch invariance (see `runner.py`) needs a matrix product whose
bits for one row do not depend on the other rows. A `MatmulKernel` names such
a product and the row multiple for which it holds; the model picks one kernel
when it is built (`select_matmul`) and every `Linear` runs on it. Kernels that
want their own weight layout (oneDNN's blocked one) reorder each weight once
into a `PackedWeight`, which is redone when the weight changes in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class MatmulKernel:
    """How every linear layer multiplies, and the row multiple that keeps a row's bits batch invariant.

    The caller pads the rows of a forward to a multiple of `row_multiple`;
    for those row counts the kernel gives each row the same bits whatever
    the other rows are (measured by tests/model/test_llama.py on the machine that
    runs them). `row_multiple` 1 claims nothing.
    """

    name: str
    row_multiple: int
    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor]  # (x, weight or pack(weight), bias)
    pack: Callable[[Tensor], Tensor] | None = None  # weight [out, in] -> the kernel's own layout


def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_pack(weight: Tensor) -> Tensor:
    # no row-count hint: oneDNN picks a blocked layout for a row count known only at run time
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


# oneDNN's fp32 matmul takes one path for every row count >= 2 (1 row is a
# matrix-vector product with other rounding), and streams the weights faster
# than MKL sgemm for the few-row products of decoding.
ONEDNN = MatmulKernel("onednn", 2, _onednn_linear)
# The same products on weights reordered once into oneDNN's blocked layout: the
# per-call reorder is gone, and 4-row products stream the weights fastest (a
# decode's lone row is padded to 4, not 2). Rows are bit-identical for every
# row count >= 2 (a lone row with more than 1024 inputs takes another path).
ONEDNN_PACKED = MatmulKernel("onednn_packed", 4, _onednn_linear, _onednn_pack)
# MKL sgemm computes rows in groups of four; a row in a remainder group (or a
# lone row) takes another path. Padding to four rows is slower than oneDNN.
MKL_PADDED = MatmulKernel("mkl", 4, F.linear)
PLAIN = MatmulKernel("torch", 1, F.linear)  # GPUs, and CPU runs that opt out of invariance


def select_matmul(device: torch.device | str, dtype: torch.dtype = torch.float32, name: str | None = None) -> MatmulKernel:
    """The matmul kernel for a device: batch-invariant float32 on CPU, torch's own elsewhere."""
    kernels = {k.name: k for k in (ONEDNN_PACKED, ONEDNN, MKL_PADDED, PLAIN)}
    if name is not None:
        if name not in kernels:
            raise ValueError(f"unknown matmul kernel {name!r} (known: {', '.join(kernels)})")
        return kernels[name]
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return PLAIN
    if not _has_onednn_linear():
        return MKL_PADDED
    return ONEDNN_PACKED if _has_onednn_pack() else ONEDNN


def _has_onednn_linear() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        _onednn_linear(torch.zeros(2, 4), torch.zeros(3, 4), None)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def _has_onednn_pack() -> bool:
    try:
        _onednn_linear(torch.zeros(4, 4), _onednn_pack(torch.zeros(3, 4)), None)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


class PackedWeight:
    """A weight reordered by its MatmulKernel, redone when the weight changes in place.

    Writes through `.data` bypass the version counter, so code that loads weights that
    way calls `Transformer.pack_weights()` afterwards (the runner does, at start-up).
    """

    def __init__(self, matmul: MatmulKernel) -> None:
        self.matmul = matmul
        self.packed: Tensor | None = None
        self.key: tuple[int, int] | None = None

    def pack(self, weight: Tensor) -> None:
        """Snapshot `weight` in the kernel's layout (no-op for kernels that use it as is)."""
        if self.matmul.pack is not None:
            with torch.no_grad():
                self.packed = self.matmul.pack(weight)
            self.key = (weight.data_ptr(), weight._version)

    def clear(self) -> None:
        self.packed, self.key = None, None

    def operand(self, weight: Tensor) -> Tensor:
        """The tensor to multiply by: the pack when there is one (repacked if stale), else the weight."""
        if self.packed is None:
            return weight
        if self.key != (weight.data_ptr(), weight._version):
            self.pack(weight)
        return self.packed


class Linear(nn.Linear):
    """nn.Linear whose product runs on the model's MatmulKernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool, matmul: MatmulKernel, **factory: Any) -> None:
        super().__init__(in_features, out_features, bias=bias, **factory)
        self.matmul = matmul
        self.packed = PackedWeight(matmul)

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul.linear(x, self.packed.operand(self.weight), self.bias)
