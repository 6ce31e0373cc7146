"""CUDA graphs for decode-only steps: one captured forward per bucket of batch sizes, replayed.

Design note. At small batches a decode step on a GPU is bound by launching its kernels, not by running
them (the Llama-3.2-1B shape on an H200: a 1-prompt step's forward took ~8-12 ms while its weights stream
in 0.64 ms). A CUDA graph launches the whole forward as one. So a step whose chunks are all single-token
decodes, each sampling one row, of n sequences runs the graph captured at the smallest bucket >= n
(BUCKETS); its padded rows are dummy decodes whose results are dropped. Every other step (a prefill
chunk, drafts, more sequences than the largest bucket, a context past the captured length) runs eagerly,
exactly as without graphs.

What a captured forward reads never moves: one set of static device buffers, sized for the largest
bucket (a bucket's graph reads their first rows), filled by copy before each replay (`fill`): the token
ids, positions, cache slots and context lengths in one int64 [4, B] buffer, and the block tables in one
int32 [B, W] buffer, W the blocks of the longest context captured. What a step's host lists would decide
is fixed at capture: the decode kernel's grid takes its number of splits from the longest context allowed
(`max_model_len`), and a split past a sequence's end stores nothing and is never read by the reduce,
so a row's bits are those of the eager step (pagoda/kernels/triton_decode.py). A padded row is a
sequence of one token whose K/V go to a scratch block past the scheduler's pool (the runner allocates it),
so it never writes a block a real sequence owns. Every bucket's graph shares one memory pool, captured
from the largest down (torch's recipe: a warm-up on a side stream, then `torch.cuda.graph`).

Bitwise: a step of n == bucket rows runs the same kernels on the same shapes as eagerly, so the same bits.
A step of n < bucket rows multiplies a padded row count: the products' bits are then those of the
bucket's row count, equal to the eager ones where the matmul is row invariant (the batch-invariant mode,
and cuBLAS wherever it picks the same kernel for both counts), not guaranteed otherwise.

Not captured: tensor-parallel groups (their collectives), the CPU. A capture that fails leaves the runner
eager, with the reason logged and in the runner's `graphs_summary`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from pagoda.kernels.metadata import AttentionMetadata
from pagoda.model.llama import StepContext

logger = logging.getLogger("pagoda.model")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes captured (those <= max_running, and max_running's own)
PACKED_ROWS = 4  # the int64 buffer's rows: token ids, positions, cache slots, context lengths


def buckets_for(max_running: int, buckets: Sequence[int] = BUCKETS) -> tuple[int, ...]:
    """The buckets worth capturing for steps of at most `max_running` sequences (the largest covers it)."""
    largest = min(max_running, max(buckets))
    return (*(b for b in buckets if b < largest), largest)


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= num_seqs (buckets ascending), None when none is."""
    return next((b for b in buckets if b >= num_seqs), None)


def unavailable(device: torch.device, model: Any) -> str | None:
    """Why this model on this device cannot run decode steps in CUDA graphs (None: it can try)."""
    if device.type != "cuda":
        return f"they need a CUDA device, and the model is on {device.type}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if model.group.communicates:
        return "a tensor-parallel group's collectives are not captured"
    return None


def decode_rows(seq_lens: Sequence[int], token_ids: Sequence[int], block_tables: Sequence[Sequence[int]],
                bucket: int, block_size: int, scratch_block: int) -> tuple[Tensor, Tensor]:
    """A decode-only step's host rows, padded to `bucket`: (packed int64 [4, bucket], tables int32 [bucket, w]).

    packed rows: token ids, positions (seq_len - 1), cache slots, context lengths. A padded row is one token
    (id 0) at position 0 of the scratch block. w: the longest table of the step (the kernels read a row's
    first cdiv(seq_len, block_size) entries only)."""
    n = len(seq_lens)
    assert n == len(token_ids) == len(block_tables) and 0 < n <= bucket, (n, len(token_ids), bucket)
    pad = bucket - n
    positions = [s - 1 for s in seq_lens]
    slots = [table[p // block_size] * block_size + p % block_size for table, p in zip(block_tables, positions)]
    packed = torch.tensor([list(token_ids) + [0] * pad, positions + [0] * pad,
                           slots + [scratch_block * block_size] * pad, list(seq_lens) + [1] * pad],
                          dtype=torch.int64)
    width = max(len(t) for t in block_tables)
    rows = [list(t) + [scratch_block] * (width - len(t)) for t in block_tables] + [[scratch_block] * width] * pad
    return packed, torch.tensor(rows, dtype=torch.int32)


class DecodeGraphs:
    """The captured decode forwards of one runner, by bucket, and their static buffers."""

    lora = None  # a LoraTable when the recorded steps add adapters' deltas (CPU step graphs); never on CUDA

    def __init__(self, runner: Any, buckets: Sequence[int], max_model_len: int, scratch_block: int) -> None:
        self.runner = runner  # pagoda.model.runner.TorchModelRunner: its model, KV caches and backend
        self.buckets = tuple(sorted(buckets))
        self.max_len = max_model_len  # the longest context a replay may hold (the kernels' grids were sized for it)
        self.block_size, self.scratch_block = runner.block_size, scratch_block
        self.width = -(-max_model_len // self.block_size)  # block table entries of the longest context
        largest, device = self.buckets[-1], runner.device
        self.packed = torch.zeros(PACKED_ROWS, largest, dtype=torch.int64, device=device)
        self.tables = torch.full((largest, self.width), scratch_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)  # one token per row
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, Tensor] = {}  # bucket -> the graph's float32 logits [bucket, V]

    def can_run(self, query_lens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                logits_rows: Sequence[int]) -> int | None:
        """The bucket a step runs in (None: eagerly): every chunk one decode that samples one row, the
        contexts and tables within what was captured."""
        bucket = bucket_for(len(seq_lens), self.buckets)
        if bucket is None or bucket not in self.graphs:
            return None
        if any(q != 1 for q in query_lens) or any(r != 1 for r in logits_rows):
            return None
        if max(seq_lens) > self.max_len or max(len(t) for t in block_tables) > self.width:
            return None
        return bucket

    def fill(self, bucket: int, seq_lens: Sequence[int], token_ids: Sequence[int],
             block_tables: Sequence[Sequence[int]]) -> None:
        """Copy a step's rows into the static buffers (what the bucket's graph reads)."""
        packed, tables = decode_rows(seq_lens, token_ids, block_tables, bucket, self.block_size, self.scratch_block)
        self.packed[:, :bucket].copy_(packed)
        self.tables[:bucket, : tables.shape[1]].copy_(tables)

    def replay(self, bucket: int, num_seqs: int) -> Tensor:
        """Run the bucket's graph over the filled buffers: float32 logits [num_seqs, V], a copy of its own."""
        self.graphs[bucket].replay()
        return self.logits[bucket][:num_seqs].clone()

    def forward(self, bucket: int) -> Tensor:
        """The forward a graph captures: the static buffers' first `bucket` rows -> float32 logits [bucket, V]."""
        runner = self.runner
        ids, positions, slots = self.packed[0, :bucket], self.packed[1, :bucket], self.packed[2, :bucket]
        # host lists fixed at capture: one token per row, contexts up to max_len (the decode kernel's splits)
        meta = AttentionMetadata(query_start_loc=self.query_start_loc[: bucket + 1],
                                 seq_lens=self.packed[3, :bucket].to(torch.int32), block_tables=self.tables[:bucket],
                                 slot_mapping=slots, positions=positions, query_lens_cpu=[1] * bucket,
                                 seq_lens_cpu=[self.max_len] * bucket, query_start_loc_cpu=list(range(bucket + 1)))
        ctx = StepContext(meta=meta, kv_caches=runner.kv_caches, backend=runner.backend, num_tokens=bucket)
        hidden = runner.model(ids, positions, ctx)  # [bucket, H]
        return runner.model.compute_logits(hidden)  # [bucket, V] float32

    def capture(self) -> None:
        """Capture every bucket's forward, the largest first, in one memory pool (torch's recipe)."""
        self._pad_all()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compiles the kernels, sets cuBLAS up, outside the capture
                for _ in range(2):
                    self.forward(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bucket] = self.forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def _pad_all(self) -> None:
        """Every row a padded one (the scratch block), so a warm-up or capture writes no real block."""
        largest = self.buckets[-1]
        packed, tables = decode_rows([1], [0], [[self.scratch_block]], largest, self.block_size, self.scratch_block)
        self.packed.copy_(packed)
        self.tables.fill_(self.scratch_block)


def start(runner: Any, max_running: int, max_model_len: int, scratch_block: int) -> tuple[DecodeGraphs | None, str]:
    """Capture the runner's decode graphs: (the graphs, what to say of them), or (None, why not) on a failure."""
    try:
        graphs = DecodeGraphs(runner, buckets_for(max_running), max_model_len, scratch_block)
        started = time.perf_counter()
        with torch.inference_mode():
            graphs.capture()
        seconds = time.perf_counter() - started
    except Exception as exc:  # a forward that cannot be captured: the engine serves eagerly
        logger.warning("CUDA graphs: capture failed, decode steps run eagerly: %r", exc)
        try:  # a capture that raised may leave this thread on torch's capture stream: back to the default one
            torch.cuda.set_stream(torch.cuda.default_stream(runner.device))
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001  (the reason above is the one to report)
            pass
        return None, f"off: the capture failed ({exc!r:.300}); every step runs eagerly"
    sizes = ",".join(map(str, graphs.buckets))
    return graphs, (f"on: decode-only steps of up to {graphs.buckets[-1]} sequences replay graphs captured at "
                    f"batch sizes {sizes} (contexts up to {max_model_len} tokens; {seconds:.1f} s to capture)")
