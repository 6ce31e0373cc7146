"""CPU step graphs: a decode step's kernel calls recorded once per bucket of batch sizes, replayed in one C++ call.

Design note. At one chat client a decode step on a small CPU is hundreds of small calls (norms, RoPE, the
KV write, attention, four products a layer), each paying torch's dispatch and Python's interpreter, and each
product forking and joining the thread pool. A step graph makes the step one call: `StepRecorder` watches
one eager forward under a torch dispatch mode and writes each kernel call it sees as a node of a program (the
op, the buffers it reads and writes, its sizes), and `pagoda_cpu::graph_run` (pagoda/kernels/cpu_graph.cpp)
replays the program in one parallel region, the GIL released, threads meeting at spinning barriers between
nodes.

- Generic. Nothing here knows a family: the recorder maps pagoda's own kernels (cpu_native's ops: the int8
  and GGUF-block products, RMSNorm, RoPE, the KV write, paged attention, the gated activation) and a few
  exact torch ops (the embedding and RoPE-table gathers, residual and bias adds, scaling, copies) to nodes,
  and treats every op whose result shares its input's storage as a view (no node). Any other op refuses the
  recording with its name, and the runner runs eagerly and says why. So every architecture plugin built
  from pagoda's layers gets graphs on the formats whose products are pagoda's kernels.
- Fixed buffers. The step's varying inputs (token ids, positions, cache slots, context lengths, block tables)
  are written into static buffers before each replay, as CUDA graphs do (`cuda_graphs.DecodeGraphs`, whose
  buckets, padding rows and scratch block this reuses). Every tensor the recording touched is kept alive
  with it, so the addresses in the program stay valid and owned.
- The same bits. A node runs the functions the eager op runs (cpu_step.h, cpu_quant.h), and each output
  element is the same instructions whichever thread's share holds it, so a replay gives each row the bits
  of the eager step; padded rows never touch a real row (each row is its own, by construction). Recording
  ends with a replay checked bit for bit against the recording's own output, and tests compare replays
  against eager steps row by row (tests/model/test_cpu_graphs.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from pagoda.kernels import cpu_native
from pagoda.kernels.metadata import AttentionMetadata
from pagoda.model import cuda_graphs, lora
from pagoda.model.llama import StepContext

logger = logging.getLogger("pagoda.model")

# CPU steps cost what their rows cost (no launch-bound floor), so buckets are finer than on a GPU
BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SLOTS, PARAMS = 20, 4  # a node's int64 slots and float64 parameters (cpu_graph.cpp)
(GATHER, RMS_NORM, ROPE, WRITE_KV, ATTENTION, INT8_LINEAR, ACT_MUL, ADD, COPY, SCALE, QUANT_ROWS, BLOCK_PRODUCT,
 SHIFT, LORA_DOWN, LORA_UP) = range(15)

_ops = torch.ops.aten
PRODUCTS = {"blocks", "int8_avx2"}  # the matmul kernels a step graph replays (pagoda's own)


class Refused(Exception):
    """An op the recorder cannot replay: the step runs eagerly."""


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


def _storage(t: Tensor) -> int:
    """The address of a tensor's storage; an opaque tensor (oneDNN's packed weights) has none to replay."""
    try:
        return t.untyped_storage().data_ptr()
    except NotImplementedError:
        raise Refused("an opaque tensor") from None


def _rows(t: Tensor) -> tuple[int, int]:
    """(rows, row stride) of a 2-D float32 tensor whose rows are contiguous."""
    if t.dim() != 2 or t.dtype != torch.float32 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise Refused(f"a float32 matrix with contiguous rows, got {tuple(t.shape)} {t.dtype} {t.stride()}")
    return t.shape[0], t.stride(0)


class StepRecorder(TorchDispatchMode):
    """Runs a forward as usual and writes the program that replays it (`code`, `params`), or why it cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.code: list[list[int]] = []
        self.params: list[list[float]] = []
        self.keep: list[Any] = []  # every tensor a node names: alive as long as the program
        self.refused: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.refused is None:
            try:
                self._record(func, list(args), kwargs, out)
            except Refused as why:
                self.refused = f"{func}: {why}"
        return out

    def _node(self, op: int, slots: Sequence[int], params: Sequence[float] = (), keep: Sequence[Any] = ()) -> None:
        assert len(slots) < SLOTS and len(params) <= PARAMS
        self.code.append([op, *slots] + [0] * (SLOTS - 1 - len(slots)))
        self.params.append([*params] + [0.0] * (PARAMS - len(params)))
        self.keep.extend(keep)

    def _record(self, func: Any, args: list[Any], kwargs: dict[str, Any], out: Any) -> None:
        tensors = [a for a in args if isinstance(a, Tensor)]
        results = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, Tensor)]
        storages = {_storage(t) for t in tensors}
        if results and all(_storage(r) in storages for r in results) and func not in _IN_PLACE:
            return  # a view (or reshape) of an input: no work
        handler = _HANDLERS.get(func)
        if handler is None:
            raise Refused("no replay for this op")
        handler(self, args, kwargs, out)

    # the handlers: one per op the replay knows, each checking the layout its node assumes

    def gather(self, table: Tensor, idx: Tensor, out: Tensor) -> None:
        if idx.dtype != torch.int64 or idx.dim() != 1 or not idx.is_contiguous() or table.dim() != 2:
            raise Refused("a gather of rows by an int64 vector")
        _rows(table)
        rows, ldo = _rows(out)
        self._node(GATHER, [_ptr(table), table.stride(0), _ptr(idx), rows, table.shape[1], _ptr(out), ldo],
                   keep=[table, idx, out])

    def add(self, a: Tensor, b: Any, out: Tensor, alpha: Any = 1) -> None:
        if alpha == 1 and _scalar(b):  # a + c (Gemma's 1 + w norms)
            self.elementwise(SHIFT, a, b, out)
            return
        if alpha != 1 or not isinstance(b, Tensor) or a.shape != out.shape:
            raise Refused("a + b of float32 matrices")
        rows, lda = _rows(a)
        _, ldo = _rows(out)
        if b.dim() == 1 and b.shape[0] == a.shape[1] and b.dtype == torch.float32 and b.is_contiguous():
            ldb = 0  # a bias: one row for all
        elif b.shape == a.shape:
            _, ldb = _rows(b)
        else:
            raise Refused(f"a + b of shapes {tuple(a.shape)} and {tuple(b.shape)}")
        self._node(ADD, [_ptr(a), lda, _ptr(b), ldb, _ptr(out), ldo, rows, a.shape[1]], keep=[a, b, out])

    def elementwise(self, op: int, x: Tensor, scalar: Any, out: Tensor) -> None:
        """out = x * scalar (SCALE) or x + scalar (SHIFT), each element one IEEE operation, as torch's."""
        if isinstance(scalar, Tensor):
            scalar = scalar.item()
        if x.dtype != torch.float32 or not x.is_contiguous() or not out.is_contiguous() or x.shape != out.shape:
            raise Refused("an elementwise op with a scalar on contiguous float32")
        self._node(op, [_ptr(x), x.numel(), _ptr(out)], [float(scalar)], keep=[x, out])

    def copy(self, src: Tensor, out: Tensor) -> None:
        if src.dtype != torch.float32 or src.dim() > 3 or not out.is_contiguous():
            raise Refused("a copy of a float32 tensor of at most 3 dimensions")
        shape = [1] * (3 - src.dim()) + list(src.shape)
        strides = [0] * (3 - src.dim()) + list(src.stride())
        self._node(COPY, [_ptr(src), *shape, *strides, _ptr(out)], keep=[src, out])

    def linear_int8(self, x: Tensor, q: Tensor, scale: Tensor, out: Tensor) -> None:
        m, ldx = _rows(x)
        self._node(INT8_LINEAR, [_ptr(x), ldx, m, _ptr(q), q.shape[1], _ptr(scale), _ptr(out), out.stride(0), q.shape[0]],
                   keep=[x, q, scale, out])

    def linear_blocks(self, x: Tensor, qs: Tensor, d: Tensor, m: Tensor, fmt: int, n: int, out: Tensor) -> None:
        rows, ldx = _rows(x)
        k = x.shape[1]
        xq = torch.empty(rows, k, dtype=torch.int8)
        xd = torch.empty(rows, k // 32, dtype=torch.float32)
        xsum = torch.empty(rows, k // 32, dtype=torch.int32)
        self._node(QUANT_ROWS, [_ptr(x), ldx, k, rows, _ptr(xq), _ptr(xd), _ptr(xsum)], keep=[x, xq, xd, xsum])
        m_ptr = _ptr(m) if m.numel() else 0
        self._node(BLOCK_PRODUCT, [fmt, _ptr(qs), _ptr(d), m_ptr, n, k, _ptr(xq), _ptr(xd), _ptr(xsum), rows,
                                   _ptr(out), out.stride(0)], keep=[qs, d, m, out])

    def lora(self, out: Tensor, x: Tensor, table: Tensor, linear: int, row_slot: Tensor, xa: Tensor) -> None:
        rows, ldo = _rows(out)
        _, ldx = _rows(x)
        _, ldxa = _rows(xa)
        self._node(LORA_DOWN, [_ptr(x), ldx, x.shape[1], _ptr(table), linear, table.shape[1], _ptr(row_slot), rows,
                               _ptr(xa), ldxa], keep=[x, table, row_slot, xa])
        self._node(LORA_UP, [_ptr(out), ldo, _ptr(table), linear, table.shape[1], _ptr(row_slot), rows, _ptr(xa), ldxa],
                   keep=[out])

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
        rows, ldx = _rows(x)
        self._node(RMS_NORM, [_ptr(x), ldx, _ptr(weight), rows, x.shape[1], _ptr(out), out.stride(0)], [eps],
                   keep=[x, weight, out])

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, out: Tensor) -> None:
        t, heads, dim = x.shape
        self._node(ROPE, [_ptr(x), x.stride(0), x.stride(1), t, heads, dim, _ptr(cos), _ptr(sin), _ptr(out)],
                   keep=[x, cos, sin, out])

    def act_mul(self, gate_up: Tensor, kind: int, out: Tensor) -> None:
        rows, ldg = _rows(gate_up)
        self._node(ACT_MUL, [_ptr(gate_up), ldg, out.shape[1], kind, _ptr(out), out.stride(0), rows],
                   keep=[gate_up, out])

    def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor) -> None:
        tokens, heads, dim = k.shape
        self._node(WRITE_KV, [_ptr(k_cache), _ptr(v_cache), heads, dim, _ptr(k), k.stride(0), k.stride(1), _ptr(v),
                              v.stride(0), v.stride(1), _ptr(slots), tokens], keep=[k_cache, v_cache, k, v, slots])

    def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, starts: Tensor, lens: Tensor,
                  scale: float, window: int, softcap: float, out: Tensor) -> None:
        self._node(ATTENTION, [_ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(tables), _ptr(starts), _ptr(lens),
                               lens.numel(), q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1],
                               tables.shape[1], window, _ptr(out)], [scale, softcap],
                   keep=[q, k_cache, v_cache, tables, starts, lens, out])


def _handlers() -> dict[Any, Any]:
    r = StepRecorder
    cpu = torch.ops.pagoda_cpu
    return {
        _ops.embedding.default: lambda s, a, k, o: r.gather(s, a[0], a[1], o),
        _ops.index_select.default: lambda s, a, k, o: r.gather(s, a[0], a[2], o) if a[1] == 0 else _refuse(),
        _ops.index.Tensor: lambda s, a, k, o: r.gather(s, a[0], a[1][0], o) if len(a[1]) == 1 else _refuse(),
        _ops.add.Tensor: lambda s, a, k, o: r.add(s, a[0], a[1], o, k.get("alpha", 1)),
        _ops.add_.Tensor: lambda s, a, k, o: r.add(s, a[0], a[1], o, k.get("alpha", 1)),
        _ops.mul.Tensor: lambda s, a, k, o: r.elementwise(s, SCALE, a[0], a[1], o) if _scalar(a[1]) else _refuse(),
        _ops.mul_.Tensor: lambda s, a, k, o: r.elementwise(s, SCALE, a[0], a[1], o) if _scalar(a[1]) else _refuse(),
        _ops.clone.default: lambda s, a, k, o: r.copy(s, a[0], o),
        _ops.contiguous.default: lambda s, a, k, o: r.copy(s, a[0], o),
        _ops.reshape.default: lambda s, a, k, o: r.copy(s, a[0], o),  # of a non-contiguous view: a copy
        cpu.rms_norm.default: lambda s, a, k, o: r.rms_norm(s, a[0], a[1], a[2], o),
        cpu.rope.default: lambda s, a, k, o: r.rope(s, a[0], a[1], a[2], o),
        cpu.act_mul.default: lambda s, a, k, o: r.act_mul(s, a[0], a[1], o),
        cpu.write_kv.default: lambda s, a, k, o: r.write_kv(s, *a[:5]),
        cpu.paged_attention.default: lambda s, a, k, o: r.attention(s, *a[:6], *_attention_options(a, k), o),
        cpu.int8_linear.default: lambda s, a, k, o: r.linear_int8(s, a[0], a[1], a[2], o),
        cpu.block_linear.default: lambda s, a, k, o: r.linear_blocks(s, *a[:6], o),
        cpu.lora_apply.default: lambda s, a, k, o: r.lora(s, *a[:6]),
    }


_IN_PLACE = {_ops.add_.Tensor, _ops.mul_.Tensor}


def _scalar(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) or (isinstance(x, Tensor) and x.dim() == 0)


def _refuse() -> None:
    raise Refused("these arguments")


def _attention_options(args: list[Any], kwargs: dict[str, Any]) -> tuple[float, int, float]:
    scale = args[6]
    window = args[7] if len(args) > 7 else kwargs.get("sliding_window", 0)
    softcap = args[8] if len(args) > 8 else kwargs.get("softcap", 0.0)
    return scale, window, softcap


_HANDLERS: dict[Any, Any] = {}


def unavailable(device: torch.device, model: Any) -> str | None:
    """Why decode steps of this model on this device cannot be CPU step graphs (None: they can try)."""
    if device.type != "cpu":
        return f"they run on the CPU, and the model is on {device.type}"
    if (why := cpu_native.load()) is not None:
        return why
    if model.group.communicates:
        return "a tensor-parallel group's collectives are not recorded"
    kernels = {model.matmul.name, model.lm_head_packed.matmul.name}
    if not kernels <= PRODUCTS:
        return (f"the products run on {'/'.join(sorted(kernels - PRODUCTS))}, not pagoda's kernels "
                f"({', '.join(sorted(PRODUCTS))}: --quantization auto on a GGUF, gguf, w8a8 or int8)")
    return None


class CpuStepGraphs(cuda_graphs.DecodeGraphs):
    """The recorded decode steps of one runner, by bucket: the static buffers of `DecodeGraphs`, a program each."""

    def __init__(self, runner: Any, buckets: Sequence[int], max_model_len: int, scratch_block: int) -> None:
        super().__init__(runner, buckets, max_model_len, scratch_block)
        self.seq_lens = torch.ones(self.buckets[-1], dtype=torch.int32)  # context lengths as attention reads them
        self.programs: dict[int, tuple[Tensor, Tensor, list[Any]]] = {}
        self.threads = torch.get_num_threads()
        self.replays = 0  # steps replayed so far
        # LoRA: each adaptable product is followed by its adapters' node, which reads each row's slot here (-1:
        # none) and the step's adapters from the runner's table (pagoda/model/lora.py)
        self.lora = runner.lora_table if runner.enable_lora else None
        self.row_slot = torch.full((self.buckets[-1],), -1, dtype=torch.int64)
        self.xa = torch.zeros(self.buckets[-1], self.lora.width if self.lora is not None else 0)  # the LoRA scratch

    def fill(self, bucket: int, seq_lens: Sequence[int], token_ids: Sequence[int],
             block_tables: Sequence[Sequence[int]]) -> None:
        super().fill(bucket, seq_lens, token_ids, block_tables)
        self.seq_lens[:bucket].copy_(self.packed[3, :bucket])

    def forward(self, bucket: int) -> Tensor:
        runner = self.runner
        ids, positions, slots = self.packed[0, :bucket], self.packed[1, :bucket], self.packed[2, :bucket]
        meta = AttentionMetadata(query_start_loc=self.query_start_loc[: bucket + 1], seq_lens=self.seq_lens[:bucket],
                                 block_tables=self.tables[:bucket], slot_mapping=slots, positions=positions,
                                 query_lens_cpu=[1] * bucket, seq_lens_cpu=[self.max_len] * bucket,
                                 query_start_loc_cpu=list(range(bucket + 1)))
        ctx = StepContext(meta=meta, kv_caches=runner.kv_caches, backend=runner.backend, num_tokens=bucket)
        if self.lora is not None:
            ctx.threads = lora.AdaptedLinears(ctx.threads, lora.LoraStep([], self.row_slot[:bucket], self.lora,
                                                                         self.xa[:bucket]))
        hidden = runner.model(ids, positions, ctx)  # [bucket, H]
        return runner.model.compute_logits(hidden)  # [bucket, V] float32

    def record(self, bucket: int) -> str | None:
        """Record the bucket's step and check one replay against it, bit for bit; None, or why it cannot run."""
        self._pad_all()
        self.seq_lens.fill_(1)
        self.row_slot.fill_(-1)
        if not _HANDLERS:
            _HANDLERS.update(_handlers())
        recorder = StepRecorder()
        with recorder:
            logits = self.forward(bucket)
        if recorder.refused is not None:
            return recorder.refused
        expected = logits.clone()
        logits.fill_(float("nan"))
        code = torch.tensor(recorder.code, dtype=torch.int64)
        params = torch.tensor(recorder.params, dtype=torch.float64)
        cpu_native.graph_run(code, params, self.threads)
        if not torch.equal(logits, expected):
            return f"a replay of the {bucket}-row step differs from its recording"
        self.programs[bucket] = (code, params, recorder.keep)
        self.logits[bucket] = logits
        self.graphs[bucket] = None  # DecodeGraphs.can_run's "recorded" mark
        return None

    def capture(self) -> None:
        for bucket in reversed(self.buckets):
            if (why := self.record(bucket)) is not None:
                raise Refused(why)

    def replay(self, bucket: int, num_seqs: int) -> Tensor:
        code, params, _ = self.programs[bucket]
        cpu_native.graph_run(code, params, self.threads)
        self.replays += 1
        return self.logits[bucket][:num_seqs].clone()

    @property
    def nodes(self) -> dict[int, int]:
        """Nodes per bucket's program."""
        return {b: p[0].shape[0] for b, p in self.programs.items()}


def start(runner: Any, max_running: int, max_model_len: int, scratch_block: int) -> tuple[CpuStepGraphs | None, str]:
    """Record the runner's decode steps: (the graphs, what to say of them), or (None, why not)."""
    try:
        graphs = CpuStepGraphs(runner, cuda_graphs.buckets_for(max_running, BUCKETS), max_model_len, scratch_block)
        started = time.perf_counter()
        with torch.inference_mode():
            graphs.capture()
        seconds = time.perf_counter() - started
    except Refused as why:
        return None, f"off: the step cannot be recorded ({why}); every step runs eagerly"
    sizes = ",".join(map(str, graphs.buckets))
    nodes = graphs.nodes[graphs.buckets[0]]
    return graphs, (f"on: decode-only steps of up to {graphs.buckets[-1]} sequences replay recorded steps of "
                    f"{nodes}+ kernel calls in one native call on {graphs.threads} threads, at batch sizes {sizes} "
                    f"(contexts up to {max_model_len} tokens; {seconds:.1f} s to record)")
