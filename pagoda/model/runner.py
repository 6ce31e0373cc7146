"""The torch model runner: a scheduler batch in, logits for the sampling chunks (and their drafts) out.

It owns the paged KV cache (per layer, k and v each
[num_blocks, block_size, num_kv_heads, head_dim], from `allocate_kv_cache`,
sized once from the `EngineConfig` the scheduler's pool follows) and turns a
`SchedulerOutput` into the flat tensors the model reads, the attention
metadata from `AttentionMetadata.build`.

Batch invariance. A request must get the same bits whether it runs alone, in
a crowd, or is recomputed by a prefill chunk after preemption; otherwise a
greedy stream can change with server load. Row-wise operations (embedding,
RMSNorm, RoPE, SiLU, residual adds) compute each row on its own and were
measured bit-identical for any row count. Matrix products are not: a BLAS
picks its code path from the row count (a lone row is a matrix-vector
product; MKL sgemm also treats a remainder of 1-3 rows apart). The model's
`MatmulKernel` states the row multiple for which a row's bits do not depend
on the other rows, and the runner pads the token rows, and the rows fed to the
LM head, to that multiple. Padding rows skip attention and are dropped. The
attention backend keeps its own per-row reduction order.

Threads. The process's thread count is set once (pagoda/core/machine.py);
the switching inside a step is here, and only here. OpenMP's waiting threads
sleep, so every parallel region pays a wake-up (50-100 us on the 2-core CI
machine), more than the work itself for the small ops of a decode or a short
prefill. So a CPU step of at most SMALL_ROWS token rows runs on one thread,
except its linear layers, which run on every thread (`StepThreads.linear`,
handed to the model in its StepContext: eight switches a layer, about 0.3 us
each) when they are big enough to repay the wake-up (a kernel's
`min_parallel_work`); and its attention runs on every thread only when the step's attention
has more than SMALL_ATTENTION score elements, on one thread otherwise (in
bigger steps too). Thread counts never change a row's bits (the kernel tests
run the attention at 1 and 4 threads). Measured (float32, 2 threads,
`pagoda bench step-ab`, two rounds, docs/performance/2026-12-01-cpu-decode-step.md
"Threads inside a step"): against switching both, switching nothing made decode steps of
1/16/64 rows and a 16-prompt prefill 1.48/1.19-1.24/1.14-1.28/1.14-1.35x as
long; switching only the attention 1.03-1.34/0.95-1.09/1.13-1.25/1.04-1.09x.
SMALL_ATTENTION (2^21) is about where a step's attention,
timed alone at the default model's shapes, may begin to gain from a second
thread: one thread was as fast or faster at every decode point of 1-64
sequences of 64-4096 tokens but one (64 x 1024, 0.59M score elements: 1.15x
slower), 170 against 190 ms at 64 x 4096 (2.4M) (`pagoda bench kernels
--threads 1` against `--threads 2`, docs/performance/2026-12-01-cpu-decode-step.md).

Graphs. On CUDA (`EngineConfig.cuda_graphs`, off by default) a decode-only step of up to 64
sequences replays a graph captured at start-up for the smallest batch-size bucket that holds it, its
rows copied into static buffers first (`fill_graph`); every other step runs as below
(pagoda/model/cuda_graphs.py). On a CPU (`EngineConfig.cpu_graphs`, on by default) the same steps replay
a recorded step in one native call (pagoda/model/cpu_graphs.py) where every kernel of the step is one of
pagoda's own. Where a capture or recording fails, the runner says why and runs eagerly.

Tensor parallelism. A step is first reduced to its `StepPlan`: the plain lists (token ids,
lengths, block tables, the rows that sample) everything after depends on. A
`TensorParallelRunner` (rank 0's) sends the plan to the other ranks in one broadcast and runs
it; every other rank receives it and runs the same `run` on its shard (pagoda/distributed).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pagoda.core.batch import RunnerOutput, SchedulerOutput
from pagoda.core.engine_config import EngineConfig
from pagoda.core.machine import cpu_facts, set_threads
from pagoda.distributed.group import GroupFailure
from pagoda.kernels import AttentionBackend, AttentionMetadata, allocate_kv_cache, select_backend
from pagoda.core.adapters import AdapterError, AdapterInfo, PreparedAdapter
from pagoda.model import cpu_graphs, cuda_graphs, lora
from pagoda.model.config import ModelConfig
from pagoda.model.invariance import prove_row_invariance
from pagoda.model.loader import weight_format
from pagoda.model.llama import StepContext, Transformer

logger = logging.getLogger("pagoda.model")

# a CPU step of at most this many token rows runs on one thread but for its linear layers (the design note)
SMALL_ROWS = 256
# a step's attention with at most this many score elements (heads x queries x keys) runs on one thread
SMALL_ATTENTION = 1 << 21


@dataclass(frozen=True)
class StepPlan:
    """What a step's forward needs of its batch, as plain lists: the message rank 0 sends each step."""

    query_lens: list[int]  # rows per chunk: its new tokens, then its drafts
    seq_lens: list[int]  # tokens in the cache after the step, per chunk
    block_tables: list[tuple[int, ...]]
    token_ids: list[int]  # every chunk's rows, concatenated
    logits_rows: list[int]  # logits rows each chunk wants, its last rows (0: none; core/batch.py)
    adapters: tuple[str | None, ...] = ()  # each chunk's LoRA adapter (None: the base); (): every chunk the base

    @classmethod
    def of(cls, batch: SchedulerOutput) -> StepPlan:
        chunks = batch.chunks
        adapters = tuple(c.request.adapter for c in chunks)
        return cls(query_lens=[c.num_rows for c in chunks], seq_lens=[c.start + c.num_rows for c in chunks],
                   block_tables=[c.block_table for c in chunks],
                   token_ids=list(itertools.chain.from_iterable(c.token_ids for c in chunks)),
                   logits_rows=[c.num_logits_rows for c in chunks],
                   adapters=adapters if any(a is not None for a in adapters) else ())


@dataclass(frozen=True)
class AdapterChange:
    """Rank 0's message to the other ranks of a group: load adapter `name` from `path` (None: unload it)."""

    name: str
    path: str | None = None
    max_rank: int = 0


@dataclass
class StepInputs:
    input_ids: Tensor  # [Tp] int64, padded
    positions: Tensor  # [Tp] int64, padded
    sample_rows: Tensor  # [Sp] int64: row of each sampling chunk's last token and of each of its drafts, padded
    num_samples: int
    ctx: StepContext
    threads: StepThreads  # the threads the step runs on (also the model's `ctx.threads`)


class TorchModelRunner:
    """Runs a `Transformer` over scheduler batches with a paged KV cache (implements ModelRunner)."""

    def __init__(self, model: Transformer, config: EngineConfig, *,
                 backend: AttentionBackend | None = None, row_multiple: int | None = None) -> None:
        self.model = model
        # weights are loaded by now: reorder them for the matmul kernel once, freeing the plain copies
        model.pack_weights(release=True)
        self.model_config: ModelConfig = model.config
        self.vocab_size = self.model_config.vocab_size
        self.num_blocks, self.block_size = config.num_blocks, config.block_size  # the pool the scheduler hands out
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # before it serves: each product's calls capped at the rows this machine proved row invariant
        self.invariance = prove_row_invariance(model.packs(), self.dtype, config.batch_invariant)
        self.backend = (backend if backend is not None
                        else select_backend(self.device, batch_invariant=config.batch_invariant))
        self.switch_threads = self.device.type == "cpu"  # the design note: a small step's work on one thread
        self.small_rows, self.small_attention = SMALL_ROWS, SMALL_ATTENTION  # its thresholds (benchmarks vary them)
        # the LM head's kernel may differ from the layers' (a float head over int4 layers)
        self.row_multiple = row_multiple or max(model.matmul.row_multiple, model.lm_head_packed.matmul.row_multiple)
        c, shard = self.model_config, model.shard
        # decode-only steps replay graphs: CUDA graphs (config.cuda_graphs, pagoda/model/cuda_graphs.py) or CPU step
        # graphs (config.cpu_graphs, pagoda/model/cpu_graphs.py), whose padded rows write a scratch block past the pool
        cpu = self.device.type == "cpu" and not config.cuda_graphs  # CUDA graphs asked for on a CPU: they say why not
        kind, asked = (cpu_graphs, config.cpu_graphs) if cpu else (cuda_graphs, config.cuda_graphs)
        why_not = kind.unavailable(self.device, model) if asked else "off: not asked for"
        graphs = asked and why_not is None
        shape = (self.num_blocks + int(graphs), self.block_size, shard.num_kv_heads, c.head_dim)  # this rank's KV heads
        self.kv_caches = [allocate_kv_cache(*shape, self.dtype, self.device) for _ in range(c.num_hidden_layers)]
        self.batch_invariant = config.batch_invariant
        self.adapters: dict[str, lora.LoraAdapter] = {}  # loaded LoRA adapters by name (pagoda/model/lora.py)
        # where a step's adapters are for pagoda's C++ kernel (None: their products run on the float kernel)
        self.lora_table = lora.LoraTable(model, config.max_loras, config.max_lora_rank) if lora.native(self.device) else None
        self.enable_lora = config.enable_lora  # step graphs hold LoRA nodes (EngineConfig)
        self.graphs: cuda_graphs.DecodeGraphs | None = None
        self.graphs_summary = why_not if not asked else f"off: {why_not}; every step runs eagerly"
        if graphs:
            self.graphs, self.graphs_summary = kind.start(self, config.max_running, config.max_model_len,
                                                          scratch_block=self.num_blocks)

    def describe(self) -> dict[str, Any]:
        """What /health and the model card say of the model: its architecture and the plugin that built it."""
        return {"architecture": {"name": self.model_config.architecture, "plugin": self.model_config.family},
                "machine": cpu_facts().describe(), "batch_invariant": self.invariance.describe(),
                "kernels": {"matmul": weight_format(self.model), "attention": self.backend.name}}

    def load_adapter(self, name: str, path: str, max_rank: int) -> AdapterInfo:
        """Read, check and hold a LoRA adapter (AdapterError, naming the field, when it is refused)."""
        return self.install_adapter(self.prepare_adapter(name, path, max_rank))

    def prepare_adapter(self, name: str, path: str, max_rank: int) -> PreparedAdapter:
        """Read, check and place a LoRA adapter over the model without holding it (AdapterError, naming the field,
        when it is refused). It reads the model and writes only the adapter's own tensors, so it may run on any
        thread while steps run."""
        adapter = lora.load_adapter(self.model, name, path, max_rank, batch_invariant=self.batch_invariant,
                                    table=self.lora_table)
        return PreparedAdapter(adapter.info, max_rank, adapter)

    def install_adapter(self, prepared: PreparedAdapter) -> AdapterInfo:
        """Hold a prepared adapter: steps may name it from now on (on the engine's thread)."""
        self.adapters[prepared.info.name] = prepared.weights
        return prepared.info

    def unload_adapter(self, name: str) -> None:
        """Free an adapter no step will name again."""
        del self.adapters[name]

    def change_adapter(self, change: AdapterChange) -> None:
        """Another rank's side of rank 0's load or unload. A load is voted on: each rank says whether it could read
        its shard of the adapter (rank 0's TensorParallelRunner.install_adapter counts the refusals)."""
        if change.path is None:
            self.adapters.pop(change.name, None)  # a load this rank refused left nothing to unload
            return
        refused = 0
        try:
            self.load_adapter(change.name, change.path, change.max_rank)
        except Exception:
            logger.exception("tensor-parallel rank %d could not load LoRA adapter %r from %s", self.model.group.rank,
                             change.name, change.path)
            refused = 1
        self.model.group.count(refused)

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """One forward over the batch: write its new KV, return float32 logits [num_sample_rows, V]."""
        if batch.is_empty:
            return RunnerOutput(logits=torch.empty(0, self.vocab_size, device=self.device))
        logits = self.run(StepPlan.of(batch))
        return RunnerOutput(logits=torch.empty(0, self.vocab_size, device=self.device) if logits is None else logits)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> Tensor | None:
        """The forward of one step's plan: its KV written, float32 logits [sample rows, V] (None: none sample,
        or this rank is not the one that samples)."""
        # a step with adapter rows replays only a recording with LoRA nodes; else it runs eagerly
        if (self.graphs is not None and (not plan.adapters or self.graphs.lora is not None)
                and (logits := self._replay(plan)) is not None):
            return logits
        inputs = self.prepare(plan)
        with inputs.threads.step():  # a small CPU step: on one thread, but for its linear layers
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.ctx)  # [Tp, H]
        if inputs.num_samples == 0:  # only partial prefill chunks this step
            return None
        logits = self.model.compute_logits(hidden[inputs.sample_rows])  # [Sp, V] (rank 0's)
        return None if logits is None else logits[: inputs.num_samples]

    def _replay(self, plan: StepPlan) -> Tensor | None:
        """A decode-only step through its bucket's graph: float32 logits [n, V] (None: it runs eagerly)."""
        bucket = self.graphs.can_run(plan.query_lens, plan.seq_lens, plan.block_tables, plan.logits_rows)
        if bucket is None:
            return None
        self.fill_graph(bucket, plan)
        return self.graphs.replay(bucket, len(plan.seq_lens))

    def fill_graph(self, bucket: int, plan: StepPlan) -> None:
        """A graph step's input preparation: its rows copied into the static buffers (and its adapters' slots)."""
        self.graphs.fill(bucket, plan.seq_lens, plan.token_ids, plan.block_tables)
        if self.graphs.lora is None:
            return
        if not plan.adapters:  # every row on the base
            self.graphs.row_slot[:bucket].fill_(-1)
        else:  # one row per sequence
            adapters, slots = lora.slots_of(self.adapters, plan.adapters, [1] * len(plan.adapters), bucket)
            self.graphs.lora.place(adapters)
            self.graphs.row_slot[:bucket].copy_(torch.tensor(slots, dtype=torch.int64))

    def prepare(self, plan: StepPlan) -> StepInputs:
        """Flatten the chunks into padded token rows and build the step's attention metadata."""
        # positions and cache slots come from the metadata builder, with tensor ops, not a loop per token
        # a chunk's rows are its own new tokens, then its drafts (core/speculative.py): a causal chunk like any
        meta = AttentionMetadata.build(plan.query_lens, plan.seq_lens, plan.block_tables, self.block_size, self.device)
        num_tokens = meta.num_tokens
        padded = _round_up(num_tokens, self.row_multiple)
        token_ids = plan.token_ids + [0] * (padded - num_tokens)
        positions = torch.cat((meta.positions, meta.positions.new_zeros(padded - num_tokens)))  # [Tp]
        ends = meta.query_start_loc_cpu[1:]
        sample_rows = [row for end, n in zip(ends, plan.logits_rows) for row in range(end - n, end)]
        num_samples = len(sample_rows)
        sample_rows += [0] * (_round_up(num_samples, self.row_multiple) - num_samples)
        threads, backend = self._threads_for(meta, padded)
        linears = threads
        if plan.adapters:  # each chunk's rows add its adapter's delta
            linears = lora.AdaptedLinears(threads, lora.LoraStep.of(self.adapters, plan.adapters, plan.query_lens,
                                                                     padded, self.device, self.lora_table))
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=positions,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=self.device),
            num_samples=num_samples,
            ctx=StepContext(meta=meta, kv_caches=self.kv_caches, backend=backend, num_tokens=num_tokens,
                            threads=linears),
            threads=threads,
        )

    def _threads_for(self, meta: AttentionMetadata, num_rows: int) -> tuple[StepThreads, AttentionBackend]:
        """The threads a step runs on, and its attention backend on the attention's own (the design note)."""
        full = narrow = attention = torch.get_num_threads()
        if self.switch_threads:
            narrow = 1 if num_rows <= self.small_rows else full
            scores = self.model_config.num_attention_heads * sum(q * k for q, k in zip(meta.query_lens_cpu,
                                                                                     meta.seq_lens_cpu))
            attention = 1 if scores <= self.small_attention else full
        backend = self.backend if attention == narrow else AttentionOn(self.backend, attention, narrow)
        return StepThreads(narrow=narrow, full=full, min_parallel_work=self.model.matmul.min_parallel_work), backend


class TensorParallelRunner(TorchModelRunner):
    """Rank 0's runner of a tensor-parallel group: each step's plan goes to every rank, then runs here too.

    The scheduler, the ledger and sampling stay on rank 0 (the engine does not know there are ranks);
    the logits come back from the group's gather, whole. A failed collective raises GroupFailure
    (a `RunnerLost`: the engine stops, pagoda/core/engine.py)."""

    def __init__(self, model: Transformer, config: EngineConfig, ranks: Any, *,
                 backend: AttentionBackend | None = None) -> None:
        ranks.group.broadcast(config)  # every rank makes its runner: its share of the heads of this pool
        super().__init__(model, config, backend=backend)
        self.ranks = ranks  # pagoda.model.ranks.Ranks
        self._in_step = False  # a step's collectives are in flight (on the engine's thread)

    def run(self, plan: StepPlan) -> Tensor | None:
        group = self.ranks.group
        self._in_step = True
        try:
            group.broadcast(plan)
            return super().run(plan)
        except GroupFailure:
            raise
        except BaseException as exc:
            # rank 0 failed mid-step alone: the others are inside the step's collectives, so the group's sequence
            # of collectives can never line up again. Not one batch's failure: the group's.
            group.failure = GroupFailure(f"tensor-parallel rank 0 failed inside a step: {exc!r}")
            raise group.failure from exc
        finally:
            self._in_step = False

    def install_adapter(self, prepared: PreparedAdapter) -> AdapterInfo:
        # prepared (checked) here first: a refused adapter reaches no rank; the others load it from its directory and
        # vote. One that cannot (its machine lacks the directory, its memory is short) makes the load fail everywhere.
        group, info = self.ranks.group, prepared.info
        group.broadcast(AdapterChange(info.name, info.path, prepared.max_rank))
        refused = group.count(0)
        if refused:
            group.broadcast(AdapterChange(info.name))  # the ranks that loaded it drop it
            raise AdapterError(f"{refused} of the tensor-parallel group's other ranks could not load LoRA adapter "
                               f"{info.name!r} from {info.path} (their log says why; the directory must exist on "
                               f"every rank's machine)", "lora_path")
        return super().install_adapter(prepared)

    def unload_adapter(self, name: str) -> None:
        super().unload_adapter(name)
        self.ranks.group.broadcast(AdapterChange(name))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "tensor_parallel": self.ranks.describe()}

    def watch(self, on_lost: Callable[[Exception], None]) -> None:
        """Call `on_lost` when a rank is lost between steps (a step in flight raises instead)."""
        self.ranks.watch(on_lost)

    def close(self) -> None:
        # from another thread while a step is still inside its collectives (a stuck step outlived its engine
        # loop's stop): the group cannot be ended in order, only abandoned
        self.ranks.close(abandon=self._in_step)


@dataclass(frozen=True)
class StepThreads:
    """A CPU step's threads: the step on `narrow`, its linear layers on `full` (the design note).

    A product of fewer multiply-adds than `min_parallel_work` stays on `narrow` (the kernel's own figure).
    """

    narrow: int
    full: int
    min_parallel_work: int = 0

    @contextmanager
    def step(self) -> Iterator[None]:
        """The forward on `narrow` threads; the process's count (`full`) after."""
        set_threads(self.narrow)
        try:
            yield
        finally:
            set_threads(self.full)

    def linear(self, layer: torch.nn.Module, x: Tensor) -> Tensor:
        if self.narrow == self.full or x.shape[0] * layer.in_features * layer.out_features < self.min_parallel_work:
            return layer(x)
        set_threads(self.full)
        try:
            return layer(x)
        finally:
            set_threads(self.narrow)


class AttentionOn:
    """A backend whose attention runs on `threads`, the step around it on `step_threads`."""

    def __init__(self, backend: AttentionBackend, threads: int, step_threads: int) -> None:
        self.backend, self.threads, self.step_threads = backend, threads, step_threads
        self.name = backend.name

    def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        self.backend.write_kv(k_cache, v_cache, k, v, slot_mapping)

    def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float,
                  **options: Any) -> Tensor:
        # options: the layer's sliding_window and softcap, passed through as the layer gave them
        set_threads(self.threads)
        try:
            return self.backend.attention(q, k_cache, v_cache, meta, scale, **options)
        finally:
            set_threads(self.step_threads)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (k and v)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * itemsize


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device: CUDA's free bytes, or the host's MemAvailable."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_num_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device, *,
                    max_model_len: int | None = None, fraction: float | None = None,
                    cpu_cap_bytes: int = 2 << 30) -> int:
    """Size the KV pool from free memory when the user gives no --num-blocks.

    CPU: 20% of available RAM, capped at `cpu_cap_bytes` (the model and other
    processes share the host). CUDA: 80% of free device memory after the
    weights are loaded (the rest is for activations and the allocator).
    At least enough blocks for one sequence of `max_model_len`.
    """
    if fraction is None:
        fraction = 0.8 if device.type == "cuda" else 0.2
    budget = int(available_memory_bytes(device) * fraction)
    if device.type == "cpu":
        budget = min(budget, cpu_cap_bytes)
    num_blocks = budget // kv_cache_bytes_per_block(config, block_size, dtype)
    floor = _round_up(max_model_len, block_size) // block_size if max_model_len else 1
    return max(num_blocks, floor)
