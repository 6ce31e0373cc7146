"""The torch model runner: a scheduler batch in, logits for the sampling chunks out.

It owns the paged KV cache (per layer, k and v each
[num_blocks, block_size, num_kv_heads, head_dim]) and turns a
`SchedulerOutput` into the flat tensors the model reads.

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
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from pagoda.core.batch import SchedulerOutput
from pagoda.model.config import ModelConfig
from pagoda.model.llama import StepContext, Transformer
from pagoda.core.batch import RunnerOutput
from pagoda.kernels import AttentionBackend, AttentionMetadata, select_backend

@dataclass
class StepInputs:
    input_ids: Tensor  # [Tp] int64, padded
    positions: Tensor  # [Tp] int64, padded
    sample_rows: Tensor  # [Sp] int64: row of each sampling chunk's last token, padded
    num_samples: int
    ctx: StepContext


class TorchModelRunner:
    """Runs a `Transformer` over scheduler batches with a paged KV cache (implements ModelRunner)."""

    def __init__(self, model: Transformer, *, num_blocks: int, block_size: int,
                 backend: AttentionBackend | None = None, row_multiple: int | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.model = model
        model.pack_weights()  # weights are loaded by now: reorder them for the matmul kernel once
        self.config: ModelConfig = model.config
        self.vocab_size = self.config.vocab_size
        self.num_blocks, self.block_size = num_blocks, block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.backend = backend if backend is not None else select_backend(self.device)
        self.row_multiple = row_multiple or model.matmul.row_multiple
        shape = (num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.config.num_hidden_layers)
        ]

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """One forward over the batch: write its new KV, return float32 logits [num_sample_chunks, V]."""
        if batch.block_size != self.block_size:
            raise ValueError(f"batch block_size {batch.block_size} != the cache's {self.block_size}")
        if batch.is_empty:
            return RunnerOutput(logits=torch.empty(0, self.vocab_size, device=self.device))
        inputs = self.prepare(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.ctx)  # [Tp, H]
        if inputs.num_samples == 0:  # only partial prefill chunks this step
            return RunnerOutput(logits=torch.empty(0, self.vocab_size, device=self.device))
        logits = self.model.compute_logits(hidden[inputs.sample_rows])  # [Sp, V]
        return RunnerOutput(logits=logits[: inputs.num_samples])

    def prepare(self, batch: SchedulerOutput) -> StepInputs:
        """Flatten the chunks into padded token rows and build the attention metadata."""
        chunks = batch.chunks
        query_lens = [c.num_tokens for c in chunks]
        seq_lens = [c.end for c in chunks]
        starts = [c.start for c in chunks]
        num_tokens = sum(query_lens)
        padded = _round_up(num_tokens, self.row_multiple)
        token_ids: list[int] = []
        for c in chunks:
            token_ids += c.token_ids
        token_ids += [0] * (padded - num_tokens)
        query_start_loc = [0, *itertools.accumulate(query_lens)]
        max_blocks = max(len(c.block_table) for c in chunks)
        tables = [list(c.block_table) + [0] * (max_blocks - len(c.block_table)) for c in chunks]

        # Per-token positions and cache slots with tensor ops, not a Python loop per token.
        lens_t = torch.tensor(query_lens)
        seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), lens_t)  # [T]
        offsets = torch.arange(num_tokens) - torch.tensor(query_start_loc[:-1])[seq_of_token]
        positions = torch.tensor(starts)[seq_of_token] + offsets  # [T]
        tables_t = torch.tensor(tables, dtype=torch.int64)  # [B, max_blocks]
        slots = tables_t[seq_of_token, positions // self.block_size] * self.block_size + positions % self.block_size
        positions = torch.cat((positions, positions.new_zeros(padded - num_tokens)))

        sample_rows = [query_start_loc[i + 1] - 1 for i, c in enumerate(chunks) if c.samples]
        num_samples = len(sample_rows)
        sample_rows += [0] * (_round_up(num_samples, self.row_multiple) - num_samples)

        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables_t.to(device=dev, dtype=torch.int32),
            slot_mapping=slots.to(dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        ctx = StepContext(meta=meta, kv_caches=self.kv_caches, backend=self.backend, num_tokens=num_tokens)
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            num_samples=num_samples,
            ctx=ctx,
        )


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
