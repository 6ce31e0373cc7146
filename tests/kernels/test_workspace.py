"""Workspace buffers are reused while they fit and regrown when they do not."""

from __future__ import annotations

import torch

from pagoda.kernels.workspace import Workspace


def test_buffers_are_reused_grown_and_retyped():
    ws = Workspace()
    a = ws.get("x", (4, 8))
    b = ws.get("x", (2, 3))
    assert b.data_ptr() == a.data_ptr() and b.is_contiguous() and b.shape == (2, 3)
    c = ws.get("x", (100,))
    assert c.numel() == 100 and ws.nbytes == 400
    d = ws.get("x", (10,), torch.bfloat16)
    assert d.dtype == torch.bfloat16
    ws.clear()
    assert ws.nbytes == 0
