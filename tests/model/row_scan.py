"""Run as a script under an ISA cap (test_isa_caps.py): every CPU weight format's products, proven at start-up as
the runner does, at every row count 1..ROWS; prints one JSON object, per format its probe and the first row
that differed from that row alone (None: none did)."""

from __future__ import annotations

import json

from pagoda.core.machine import prepare_process

prepare_process()

import torch  # noqa: E402

from pagoda.kernels import cpu_native  # noqa: E402
from pagoda.model import matmul as mm  # noqa: E402
from pagoda.model.invariance import prove_row_invariance  # noqa: E402
from pagoda.model.quantize import has_int_kernels  # noqa: E402

ROWS = 300
IN, OUT = 576, 1536  # the default model's MLP: a small shape can keep oneDNN off AMX tiles altogether


def formats() -> list[mm.MatmulKernel]:
    kernels = [mm.MKL_PADDED]
    if mm.select_matmul("cpu") in (mm.ONEDNN, mm.ONEDNN_PACKED):
        kernels += [mm.ONEDNN, mm.ONEDNN_PACKED]
    kernels += [mm.ONEDNN_BF16] if mm.has_onednn_bf16() else []
    kernels += [mm.INT8, mm.INT4] if has_int_kernels() else []
    kernels += [mm.INT8_AVX2] if cpu_native.available() else []
    return kernels


def first_variant_row(packed: mm.PackedWeight, weight: torch.Tensor, rows: int = ROWS) -> list[int] | None:
    """[row count, position] of the first row whose bits differ from the row alone, both padded as the runner pads."""
    r = packed.matmul.row_multiple
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows + r, IN, generator=gen)

    def padded(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0]
        return packed.product(torch.cat((t, t.new_zeros(-n % r, IN))), weight, None)[:n]

    alone = torch.stack([padded(x[i : i + 1])[0] for i in range(rows)])
    for n in range(1, rows + 1):
        out = padded(x[:n])
        for at in range(n):
            if not torch.equal(out[at], alone[at]):
                return [n, at]
    return None


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = {}
    for kernel in formats():
        weight = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)) * 0.05
        packed = mm.PackedWeight(kernel)
        packed.pack(weight)
        report = prove_row_invariance([(packed, weight)])
        probe = next(iter(report.products.values()))
        with torch.inference_mode():
            differs = first_variant_row(packed, weight)
        result[kernel.name] = {"max_rows": probe.max_rows, "switch": probe.first_variant, "differs": differs}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
