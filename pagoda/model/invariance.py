"""Row invariance, proven on this machine at start-up: how many rows one call of each product may take.

Design note. Batch invariance (runner.py) needs every product to give a row the same bits whatever
the other rows are. A kernel's `row_multiple` (matmul.py) says for which row counts its authors saw
that hold, but a BLAS picks its kernel by the row count, and where it switches depends on the CPU:
oneDNN's bfloat16 products switch to AMX tiles at 33 rows on a Xeon with AMX (a row of a 33-row call
gets other bits than the same row alone), MKL's float32 sgemm switches at 13 rows there, and neither
switches at all on a Zen 4. So before an engine serves, it measures:

- For each distinct product of the model (kernel, [out, in]) it multiplies random rows alone (each
  padded to the row multiple, as a decode's lone row is), then in calls of r, 2r, ... rows up to
  PROBE_ROWS, and compares every row of every call with that row alone, bit for bit. The first call
  whose rows differ ends the scan; the row count before it is the largest that was proven.
- The product then runs in calls of at most that many rows (`PackedWeight.max_rows`): a product of any
  size is a run of calls each of a proven size, so every row gets its alone bits at every row count, with
  no bound to prove beyond PROBE_ROWS. A call of fewer rows is never slower, so a machine whose kernels
  never switch loses nothing; one that switches at 33 pays about 1.3x on a 64-row product, where capping
  oneDNN's ISA would cost 7.5x and padding every call to 64 rows 2.4x on a lone row (docs/architecture.md).
- The result is cached per machine (the CPU's model and flags, torch's version, oneDNN's ISA cap, the
  thread count) and per shape in $PAGODA_HOME/invariance, so the second start costs nothing.

`--no-batch-invariant` skips the probe: every product is one call, on the fastest kernels, and answers
may depend on the batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from pagoda.core.machine import ONEDNN_ISA_ENV, cpu_facts
from pagoda.model.hub import pagoda_home
from pagoda.model.matmul import MatmulKernel, PackedWeight

logger = logging.getLogger("pagoda.model")

# kernels off the CPU whose bits never depend on the row count, by construction (pagoda/kernels/triton_matmul.py)
INVARIANT_BY_CONSTRUCTION = {"triton_invariant"}
PROBE_ROWS = 256  # the largest call proven: a product of more rows runs as calls of at most this many
MIN_ELEMENTS = 1 << 18  # output elements compared at each row count (where the pool of rows has them)


@dataclass(frozen=True)
class RowProbe:
    """What one product's scan found: calls of up to `max_rows` rows are row invariant here."""

    max_rows: int  # the largest proven call (a multiple of the row multiple); 0 when not even one was
    first_variant: int | None  # the first call's row count whose rows differed from alone; None: none up to the bound


def probe_rows(matmul: MatmulKernel, operand: object, in_features: int, bound: int = PROBE_ROWS,
               dtype: torch.dtype = torch.float32) -> RowProbe:
    """Scan calls of r, 2r, ... up to `bound` rows of `matmul` on `operand` (its [out, in] weight in the kernel's
    layout) and compare each row with the same row multiplied alone (padded to r rows), bit for bit.

    A switched kernel may differ from the other in few elements: a bfloat16 output rounds most of the float32
    accumulators' differences away (seen: 4 of 34,560 elements of a 36-row call). So each row count is tried
    on at least MIN_ELEMENTS output elements, several calls over a pool of `bound` random rows."""
    r = matmul.row_multiple
    bound = bound // r * r
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(bound, in_features, generator=gen).to(dtype)
    pad = pool.new_zeros(r - 1, in_features)
    with torch.inference_mode():
        alone = torch.stack([matmul.linear(torch.cat((pool[i : i + 1], pad)), operand, None)[0]
                             for i in range(bound)])
        out_features = alone.shape[1]
        for rows in range(r, bound + 1, r):
            calls = max(1, min(bound // rows, -(-MIN_ELEMENTS // (rows * out_features))))
            for call in range(calls):
                part = slice(call * rows, (call + 1) * rows)
                if not torch.equal(matmul.linear(pool[part], operand, None), alone[part]):
                    return RowProbe(rows - r, rows)
    return RowProbe(bound, None)


@dataclass
class InvarianceReport:
    """What the probe chose for a model, for the start-up line, /health and the model card."""

    batch_invariant: bool
    # per product shape "kernel out x in": its largest proven call and the first call that differed (or None)
    products: dict[str, RowProbe] = field(default_factory=dict)
    device_kernels: set[str] = field(default_factory=set)  # the kernels of products off the CPU (not probed)

    @property
    def proven(self) -> bool:
        """Whether every CPU product got at least one proven call size and every other runs an invariant kernel."""
        return (self.batch_invariant and all(p.max_rows > 0 for p in self.products.values())
                and self.device_kernels <= INVARIANT_BY_CONSTRUCTION)

    def summary(self) -> str:
        """One line: the path taken and why."""
        if not self.batch_invariant:
            return "off (--no-batch-invariant): the fastest kernels, one call per product; answers may depend on the batch"
        if self.device_kernels and not self.products:  # not a CPU: invariance is the choice of kernels (matmul.py)
            names = ", ".join(sorted(self.device_kernels))
            if self.proven:
                return f"on: {names}, whose tiles never depend on the row count"
            return f"on, NOT proven: {names} may give a row other bits in another batch (use the loader's choice)"
        capped = {k: p for k, p in self.products.items() if p.first_variant is not None}
        if not capped:
            return f"on: every product proven row invariant in calls of up to {PROBE_ROWS} rows on this CPU"
        parts = [f"{k} in calls of at most {p.max_rows} rows (a {p.first_variant}-row call changed a row's bits)"
                 for k, p in capped.items()]
        return "on: " + "; ".join(parts) + ("" if self.proven else " -- NOT proven: no call size kept rows alone")

    def describe(self) -> dict[str, object]:
        """For /health and the model card."""
        return {"on": self.batch_invariant, "why": self.summary(), "proven": self.proven,
                "max_rows": {k: p.max_rows for k, p in self.products.items()}}


def _cache_path(key: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return pagoda_home() / "invariance" / f"{digest}.json"


def _machine_key() -> dict[str, object]:
    cpu = cpu_facts()
    return {"cpu": cpu.model, "flags": sorted(cpu.flags), "torch": torch.__version__,
            "onednn_isa": os.environ.get(ONEDNN_ISA_ENV), "threads": torch.get_num_threads()}


def cached_probe(matmul: MatmulKernel, operand: object, shape: tuple[int, int], dtype: torch.dtype,
                 bound: int = PROBE_ROWS) -> RowProbe:
    """`probe_rows` through the on-disk cache of this machine's results."""
    key = {**_machine_key(), "probe": [PROBE_ROWS, MIN_ELEMENTS], "kernel": matmul.name, "row_multiple": matmul.row_multiple, "shape": list(shape),
           "dtype": str(dtype), "bound": bound}
    path = _cache_path(key)
    try:
        found = json.loads(path.read_text())
        return RowProbe(int(found["max_rows"]), found["first_variant"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    probe = probe_rows(matmul, operand, shape[1], bound, dtype)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "max_rows": probe.max_rows, "first_variant": probe.first_variant}))
        tmp.replace(path)
    except OSError as exc:  # a read-only home: the probe runs again next time
        logger.warning("could not cache the row-invariance probe in %s: %s", path.parent, exc)
    return probe


def prove_row_invariance(packs: list[tuple[PackedWeight, Tensor]], dtype: torch.dtype = torch.float32,
                         batch_invariant: bool = True) -> InvarianceReport:
    """Probe each distinct product of `packs` (a model's `packs()`, weights packed) and cap its calls' rows at
    what was proven; with `batch_invariant` False, lift every cap instead. Returns what was chosen."""
    report = InvarianceReport(batch_invariant)
    for packed, weight in packs:
        packed.max_rows = 0
        if not batch_invariant:
            continue
        if weight.device.type != "cpu":
            report.device_kernels.add(packed.matmul.name)
            continue
        shape = packed.shape or tuple(weight.shape)
        name = f"{packed.matmul.name} {shape[0]}x{shape[1]}"
        if name not in report.products:
            report.products[name] = cached_probe(packed.matmul, packed.operand(weight), shape, dtype)
        packed.max_rows = report.products[name].max_rows or packed.matmul.row_multiple
    return report
