"""Batch-invariant paged attention for the CPU, in vectorized torch.

Design note. A query row (sequence, position) must get the same bits whether
it is decoded alone, decoded beside other sequences, or recomputed inside a
prefill chunk of any length at any offset. Every step below is chosen so that
the arithmetic done for one row depends only on that row's query and context:

* Keys are folded in chunks of CHUNK absolute positions (chunk c holds
  positions [c*CHUNK, (c+1)*CHUNK) whatever the batch), in order, by an online
  softmax. A row sees keys 0..pos; the rest are masked to -inf. A chunk wholly
  after a row leaves its running max unchanged, so alpha = exp(0) = 1 and it
  adds exact zeros: folding it in, or skipping it, is a bitwise no-op.
* Within a chunk, keys form tiles of TILE positions. Scores are q @ k^T with
  the reduction over head_dim only; P @ V is one matmul per tile, so its
  reduction length is always TILE. MKL sgemm computes a row differently when
  it falls in a piece of 1-3 rows (measured: matrices of 1-3 rows always; 5-7,
  9-11, 17-19... rows when threads split them), so every matmul gets a
  multiple of ROW_MULTIPLE rows, query rows being zero-padded. With that, an
  element's bits did not depend on the other rows or columns, for 1 to 32 threads.
* The chunk's max is exact (a max is order free); probabilities are summed
  within each tile (fixed length TILE), and tile partials by a pairwise tree
  (an odd one out carried up). That tree equals the tree over the tile count
  zero-padded to a power of two, so a chunk cut short in one batch and not in
  another gives the same bits. torch.exp is used, not the faster exp2, whose
  vector and scalar-tail code disagree in the last bit on this build.

Work is grouped for speed only: decodes of similar length share one batched
matmul, and a prefill chunk is folded a few hundred rows at a time, each step
reading only the tiles up to its last position. The grouping never changes the
bits, which is why it can follow a memory budget. The tests check all of this
with torch.equal, with several chunks per context.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pagoda.kernels.kv_cache import gather_contexts, write_kv
from pagoda.kernels.metadata import AttentionMetadata
from pagoda.kernels.workspace import Workspace

TILE = 64  # key positions per tile: the fixed reduction length of every P @ V product
CHUNK = 1024  # key positions per chunk (rounded up to whole tiles and blocks): the online-softmax step
ROW_MULTIPLE = 4  # matmul row counts are padded to a multiple of this (MKL rounds 1-3 row pieces apart)
MIN_COLS = 16  # and column counts to at least this
# elements per step in the score tensor and in the gathered K (and V) chunk: working sets of a
# few MB stay in cache and are reused, instead of page-faulting fresh memory every call
SCORE_BUDGET = 1 << 20
KV_BUDGET = 1 << 20


def cpu_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    workspace: Workspace | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """q [T, H, D] -> out [T, H, D]; causal paged attention, bitwise batch invariant per row."""
    ws = workspace or Workspace()
    out = torch.empty_like(q) if out is None else out
    num_kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    chunk = _round_up(CHUNK, _key_unit(k_cache))
    decodes = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
    # per key of a chunk, a decode holds KVH * rows scores and KVH * D gathered values of K (and V)
    rows = _round_up(group, ROW_MULTIPLE)
    max_keys = min(SCORE_BUDGET // (num_kv_heads * rows), KV_BUDGET // (num_kv_heads * dim))
    for seqs in _decode_groups(decodes, meta.seq_lens_cpu, chunk, max_keys):
        _attend_decodes(q, k_cache, v_cache, meta, scale, seqs, chunk, out, ws)
    for b, n in enumerate(meta.query_lens_cpu):
        if n > 1:
            _attend_chunk(q, k_cache, v_cache, meta, scale, b, chunk, out, ws)
    return out


def _key_unit(k_cache: Tensor) -> int:
    """Key spans are whole tiles and whole blocks, so a gather never splits a block."""
    return math.lcm(TILE, k_cache.shape[1])


def _decode_groups(decodes: list[int], seq_lens: list[int], chunk: int, max_keys: int) -> list[list[int]]:
    """Split decode sequences, sorted by length, into groups holding at most max_keys keys per chunk."""
    groups: list[list[int]] = []
    current: list[int] = []
    for b in sorted(decodes, key=lambda b: seq_lens[b]):
        keys = min(seq_lens[b], chunk)  # the longest so far, as the list is sorted
        if current and (len(current) + 1) * keys > max_keys:
            groups.append(current)
            current = []
        current.append(b)
    if current:
        groups.append(current)
    return groups


def _attend_decodes(q, k_cache, v_cache, meta, scale, seqs, chunk, out, ws) -> None:
    """One query row per sequence: its G query heads per kv head are the rows, padded to ROW_MULTIPLE."""
    num_kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    lens = [meta.seq_lens_cpu[b] for b in seqs]
    tokens = meta.query_start_loc[seqs].to(torch.int64)
    rows = _round_up(group, ROW_MULTIPLE)
    q_rows = torch.zeros((num_kv_heads, len(seqs), rows, dim), dtype=torch.float32)
    q_rows[:, :, :group] = q[tokens].view(len(seqs), num_kv_heads, group, dim).transpose(0, 1).float() * scale
    # padded rows (discarded) copy the real rows' position so they widen no mask
    row_pos = (torch.tensor(lens, dtype=torch.int64)[:, None] - 1).expand(len(seqs), rows)
    o = _attend_rows(q_rows, row_pos, k_cache, v_cache, meta.block_tables[seqs], lens, chunk, rows, ws)
    out[tokens] = o[:, :, :group].transpose(0, 1).reshape(len(seqs), num_kv_heads * group, dim).to(out.dtype)


def _attend_chunk(q, k_cache, v_cache, meta, scale, b, chunk, out, ws) -> None:
    """The new tokens of sequence b: row r of kv head h is (token r // G, query head h * G + r % G)."""
    num_kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    token_start, qlen, seq_len = meta.query_starts_cpu[b], meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
    rows = _round_up(qlen * group, ROW_MULTIPLE)
    new = q[token_start : token_start + qlen]  # [qlen, H, D]
    q_rows = torch.zeros((num_kv_heads, 1, rows, dim), dtype=torch.float32)
    q_rows[:, 0, : qlen * group] = (
        new.reshape(qlen, num_kv_heads, group, dim).transpose(0, 1).reshape(num_kv_heads, -1, dim).float() * scale
    )
    row_pos = torch.full((1, rows), seq_len - 1, dtype=torch.int64)  # padded rows: the last position
    row_pos[0, : qlen * group] = torch.arange(seq_len - qlen, seq_len).repeat_interleave(group)
    # rows per step: bound the score tensor [KVH, rows, chunk] by SCORE_BUDGET
    step = max(ROW_MULTIPLE, SCORE_BUDGET // (num_kv_heads * chunk) // ROW_MULTIPLE * ROW_MULTIPLE)
    o = _attend_rows(q_rows, row_pos, k_cache, v_cache, meta.block_tables[b : b + 1], [seq_len], chunk, step, ws)
    o = o[:, 0, : qlen * group].reshape(num_kv_heads, qlen, group, dim).transpose(0, 1)
    out[token_start : token_start + qlen] = o.reshape(qlen, num_kv_heads * group, dim).to(out.dtype)


def _attend_rows(q, row_pos, k_cache, v_cache, block_tables, lens, chunk, step, ws) -> Tensor:
    """q [KVH, N, R, D] (scaled), row_pos [N, R] -> [KVH, N, R, D]: online softmax over fixed key chunks.

    Chunk c holds keys [c * chunk, (c + 1) * chunk) whatever the batch, and chunks are folded in
    order. A chunk wholly after a row's position leaves it exactly unchanged (alpha = exp(0) = 1,
    nothing added), so the row's bits depend only on the chunks it sees.
    """
    num_kv_heads, n, rows, dim = q.shape
    row_max = torch.full((num_kv_heads, n, rows), float("-inf"))
    denom = torch.zeros((num_kv_heads, n, rows))
    numer = torch.zeros((num_kv_heads, n, rows, dim))
    end = _round_up(int(row_pos.max()) + 1, _key_unit(k_cache))
    for start in range(0, end, chunk):
        k, v = gather_contexts(k_cache, v_cache, block_tables, lens, min(chunk, end - start), ws, start)
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            last = int(row_pos[:, lo:hi].max())
            if last < start:
                continue  # every row of the step is before this chunk: folding it in is a no-op
            keys = min(k.shape[1], _round_up(last + 1 - start, TILE))  # tiles after every row: no-ops too
            _fold_chunk(q[:, :, lo:hi], row_pos[:, lo:hi], k[:, :keys], v[:, :keys], start, ws,
                        row_max[:, :, lo:hi], denom[:, :, lo:hi], numer[:, :, lo:hi])  # fmt: skip
    return numer / denom[..., None]


def _fold_chunk(q, row_pos, k, v, start, ws, row_max, denom, numer) -> None:
    """Fold keys [start, start + L) (k/v [N, L, KVH, D]) into the running (max, sum, weighted V) in place."""
    num_kv_heads, n, rows, dim = q.shape
    length = k.shape[1]
    tiles = length // TILE
    scores = ws.get("scores", (num_kv_heads, n, rows, length))
    for h in range(num_kv_heads):  # k[:, :, h] is a strided view: no copy of K per head
        torch.bmm(q[h], k[:, :, h].transpose(1, 2), out=scores[h])  # one dot over D per element
    # keys up to the first row's position are visible to every row: mask only the band after it
    band = max(0, int(row_pos.min()) + 1 - start)
    if band < length:
        hidden = torch.arange(start + band, start + length) > row_pos[:, :, None]  # causal and past the end
        scores[..., band:].masked_fill_(hidden, float("-inf"))
    new_max = torch.maximum(row_max, scores.amax(dim=-1))  # exact, order free; finite from chunk 0 on
    alpha = torch.exp(row_max - new_max)  # exactly 1 for a row that sees nothing new
    probs = scores.sub_(new_max[..., None]).exp_().view(num_kv_heads, n, rows, tiles, TILE)  # hidden -> 0
    if dim < MIN_COLS:  # keep P @ V off MKL's few-column path
        v = torch.nn.functional.pad(v, (0, MIN_COLS - dim))
    cols = v.shape[-1]
    parts = ws.get("parts", (num_kv_heads, n * tiles, rows, cols))
    probs_t = ws.get("probs_t", (n, tiles, rows, TILE))
    for h in range(num_kv_heads):
        probs_t.copy_(probs[h].transpose(1, 2))
        # [N * tiles, R, TILE] @ [N * tiles, TILE, D]: every reduction is TILE long
        torch.bmm(probs_t.view(-1, rows, TILE), v[:, :, h].reshape(n * tiles, TILE, cols), out=parts[h])
    chunk_numer = _tree_sum(parts.view(num_kv_heads, n, tiles, rows, cols), dim=2)[..., :dim]
    denom.mul_(alpha).add_(_tree_sum(probs.sum(dim=-1), dim=3))
    numer.mul_(alpha[..., None]).add_(chunk_numer)
    row_max.copy_(new_max)


def _tree_sum(x: Tensor, dim: int) -> Tensor:
    """Sum over `dim` by pairing neighbours level by level; equal to zero-padding it to a power of two."""
    while x.shape[dim] > 1:
        count = x.shape[dim]
        pairs = x.narrow(dim, 0, count - count % 2).unflatten(dim, (count // 2, 2))
        summed = pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)
        x = torch.cat([summed, x.narrow(dim, count - 1, 1)], dim) if count % 2 else summed
    return x.squeeze(dim)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class CpuBackend:
    """AttentionBackend for the CPU: vectorized torch, bitwise batch invariant (see the design note)."""

    name = "cpu"

    def __init__(self) -> None:
        self.workspace = Workspace()  # scratch reused across steps; one backend serves one runner thread

    def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """Store new K/V through slot_mapping."""
        write_kv(k_cache, v_cache, k, v, slot_mapping)

    def attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
    ) -> Tensor:
        """Causal attention of the new tokens over their cached context."""
        return cpu_attention(q, k_cache, v_cache, meta, scale, self.workspace)
