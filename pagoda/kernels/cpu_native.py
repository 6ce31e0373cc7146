"""pagoda's C++ kernels for x86 CPUs with AVX2 and FMA: int8 weight-only products, paged attention,
RMSNorm and RoPE.

Design note. The places where a decode step on a small CPU spends its time in torch are written here in
C++ (`cpu_int_matmul.cpp`, `cpu_paged_attention.cpp`), each batch invariant by construction: every
output element is one fixed instruction sequence over its own row's inputs, whatever the row count,
the tile, the thread or the step, so a row's bits never depend on the other rows (tested at every row
count and thread count, alone, in a crowd and after preemption).

- int8 products. torch's int8/int4 CPU kernels want bfloat16 activations and, without AVX-512,
  stream the weights at a tenth of the memory bandwidth for a decode's few rows. These keep float32
  activations and accumulation and convert each weight in registers as it streams past.
- Paged attention. The torch fold (`cpu_attention.py`) is tens of small ops a layer, most of a 1-row
  step's attention time; this is one call a layer.
- RMSNorm and RoPE (`cpu_rms_norm.cpp`): one call each for torch's six or seven small ops.

The sources are compiled on first use with torch's extension builder (g++, ninja) into a cache
directory ($PAGODA_HOME/kernels, like the models) keyed by the sources, torch's version and the flags,
with a line on stderr; later processes load the cached library in milliseconds. `available()` is False
where the CPU lacks AVX2/FMA or nothing can be compiled; callers then keep torch's kernels.
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

_HERE = Path(__file__).parent
SOURCES = sorted(_HERE.glob("cpu_*.cpp"))  # every C++ kernel of this folder, built into one library
HEADERS = sorted(_HERE.glob("cpu_*.h"))
_LIBRARY = "pagoda_cpu"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-std=c++17"]  # no contraction: fma only where written


def cache_dir() -> Path:
    """Where the compiled library lives: under $PAGODA_HOME (~/.cache/pagoda), per source, torch and flags."""
    env = os.environ.get("PAGODA_HOME")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "pagoda"
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(_FLAGS).encode())
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    return root / "kernels" / f"cpu-{digest.hexdigest()[:16]}"


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
    try:
        build.mkdir(parents=True, exist_ok=True)
        if not (build / f"{_LIBRARY}.so").exists():
            print(f"pagoda: compiling the C++ CPU kernels once (cached in {build})", file=sys.stderr, flush=True)
        with _ninja_on_path():
            cpp_extension.load(name=_LIBRARY, sources=[str(p) for p in SOURCES], extra_cflags=_FLAGS,
                               extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False,
                               verbose=False)
    except (OSError, RuntimeError, ImportError) as error:  # an unwritable cache, no compiler, no ninja, a failed build
        return f"the C++ CPU kernels did not build: {str(error).strip().splitlines()[-1] if str(error).strip() else error!r}"
    return None


def available() -> bool:
    """Whether the kernels are loaded (built on the first call)."""
    return load() is None


def int8_linear(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x [T, K] float32 @ (q [N, K] int8 * scale [N] float32).T -> [T, N] float32."""
    return torch.ops.pagoda_cpu.int8_linear(x.contiguous(), q, scale)


def block_linear(x: Tensor, qs: Tensor, d: Tensor, m: Tensor, fmt: int, n: int) -> Tensor:
    """x [T, K] float32 @ a packed Q4_0 (fmt 0) / Q4_1 (1) / Q8_0 (2) weight [n, K] -> [T, n] float32, the
    activations quantized to int8 per block of 32 (layout and arithmetic: cpu_quant.h)."""
    return torch.ops.pagoda_cpu.block_linear(x.contiguous(), qs, d, m, fmt, n)


def quant_isa(name: str = "") -> str:
    """Make ISA variant `name` ("portable", "avx2", "avx_vnni", "avx512_vnni", "best") run the block products;
    returns the one before. "" only reads it."""
    return torch.ops.pagoda_cpu.quant_isa(name)


def quant_isas() -> list[str]:
    """The block products' ISA variants this CPU runs, best last."""
    return list(torch.ops.pagoda_cpu.quant_isas())


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, query_start_loc: Tensor,
                    seq_lens: Tensor, scale: float, sliding_window: int = 0, softcap: float = 0.0) -> Tensor:
    """q [T, H, D] float32 -> out [T, H, D]: each new token attends causally to its paged context (its last
    `sliding_window` keys if > 0), scores soft-capped by `softcap` if > 0 (the AttentionBackend contract)."""
    return torch.ops.pagoda_cpu.paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                                sliding_window, softcap)


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store the new tokens' K/V [T, KVH, D] float32 into their cache slots [T] (kv_cache.write_kv's contract)."""
    torch.ops.pagoda_cpu.write_kv(k_cache, v_cache, k, v, slot_mapping)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [T, H] float32 -> (x / sqrt(mean(x^2) + eps)) * weight, per row."""
    return torch.ops.pagoda_cpu.rms_norm(x, weight, eps)


def rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x [T, heads, D] float32 (unit stride along D) -> rotate-half RoPE, the same bits as llama.apply_rope's."""
    return torch.ops.pagoda_cpu.rope(x, cos.contiguous(), sin_signed.contiguous())


ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # act_mul's kinds (cpu_step.h)


def act_mul(gate_up: Tensor, activation: str) -> Tensor:
    """gate_up [T, 2I] float32 -> act(gate) * up [T, I], act one of ACTIVATIONS (cpu_activation.cpp)."""
    return torch.ops.pagoda_cpu.act_mul(gate_up, ACTIVATIONS[activation])


def lora_apply(out: Tensor, x: Tensor, table: Tensor, linear: int, row_slot: Tensor, xa: Tensor) -> None:
    """out [T, N] += each row's LoRA delta, in place: row t adds the adapter in slot row_slot[t] (-1: none), whose
    segments for projection `linear` table [slots, projections, 3] int64 names; xa [T, W] is scratch, W at least a
    row's total rank (cpu_lora.cpp)."""
    torch.ops.pagoda_cpu.lora_apply(out, x.contiguous(), table, linear, row_slot, xa)


def graph_run(code: Tensor, params: Tensor, threads: int) -> None:
    """Replay a recorded step (pagoda/model/cpu_graphs.py) in one parallel region of `threads`, the GIL released."""
    torch.ops.pagoda_cpu.graph_run(code, params, threads)
