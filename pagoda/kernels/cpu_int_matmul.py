"""pagoda's own int8 and int4 weight-only products for x86 CPUs with AVX2 and FMA (cpu_int_matmul.cpp).

Design note. torch's int8/int4 CPU kernels want bfloat16 activations and, without AVX-512, stream the
weights at a tenth of the memory bandwidth for a decode's few rows. These kernels keep float32
activations and accumulation, convert each weight in registers as it streams past, and compute every
output element with one fixed instruction sequence whatever the row count, the tile or the thread, so a
row's bits never depend on the other rows (batch invariant by construction, tested at every row count).

The C++ source is compiled on first use with torch's extension builder (gcc, ninja) into a cache
directory ($PAGODA_HOME/kernels, like the models) keyed by the source, torch's version and the flags,
with a line on stderr; later processes load the
cached library in milliseconds. `available()` is False where the CPU lacks AVX2/FMA or nothing can be
compiled; the callers then keep torch's kernels.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("cpu_int_matmul.cpp")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-std=c++17"]  # no contraction: fma only where written


def cache_dir() -> Path:
    """Where the compiled library lives: under $PAGODA_HOME (~/.cache/pagoda), per source, torch and flags."""
    env = os.environ.get("PAGODA_HOME")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "pagoda"
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    return root / "kernels" / f"cpu_int_matmul-{key}"


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    # torch's builder runs `ninja` from PATH; the ninja wheel (a dependency) puts one in the venv,
    # which is not on PATH when pagoda runs as .venv/bin/pagoda. Only the build sees the change.
    if shutil.which("ninja"):
        yield
        return
    import ninja

    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join((ninja.BIN_DIR, before))
    try:
        yield
    finally:
        os.environ["PATH"] = before


def cpu_supports() -> bool:
    """Whether this CPU runs AVX2 with FMA (torch's own dispatch says so)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def load() -> str | None:
    """Compile (once) and load the kernels; None when loaded, else why they are not available."""
    if not cpu_supports():
        return f"this CPU lacks AVX2/FMA ({torch.backends.cpu.get_cpu_capability()})"
    from torch.utils import cpp_extension

    build = cache_dir()
    build.mkdir(parents=True, exist_ok=True)
    library = build / "pagoda_cpu_int_matmul.so"
    if not library.exists():
        print(f"pagoda: compiling the int8/int4 CPU kernels once (cached in {build})", file=sys.stderr, flush=True)
    try:
        with _ninja_on_path():
            cpp_extension.load(name="pagoda_cpu_int_matmul", sources=[str(SOURCE)], extra_cflags=_FLAGS,
                               extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False,
                               verbose=False)
    except (OSError, RuntimeError, ImportError) as error:  # no compiler, no ninja, a failed build
        return f"the CPU int kernels did not build: {str(error).strip().splitlines()[-1] if str(error).strip() else error!r}"
    return None


def available() -> bool:
    return load() is None


def int8_linear(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x [T, K] float32 @ (q [N, K] int8 * scale [N] float32).T -> [T, N] float32."""
    return torch.ops.pagoda_cpu.int8_linear(x.contiguous(), q, scale)


def int4_linear(x: Tensor, packed: Tensor, dm: Tensor) -> Tensor:
    """x [T, K] float32 @ w.T -> [T, N] float32, w = q * d + m per group of 32 (Q4_1's nibble order; dm [N, 2, K/32])."""
    return torch.ops.pagoda_cpu.int4_linear(x.contiguous(), packed, dm)
