"""The CPU backend's per-step attention plan: what every layer of a step reads, worked out once.

Design note. Everything the CPU attention (`cpu_attention.py`) does that
depends only on the step's metadata, not on a layer's Q/K/V, is decided here:
which query rows are folded together, which cache blocks each group reads,
which slots lie past a sequence's end, and the masks. The backend builds one
`AttentionPlan` per step and reuses it for every layer, so a decode costs
about 20 torch ops per layer.

The numerics fix three sizes (see the note in `cpu_attention.py`): keys are
folded in chunks of CHUNK absolute positions, each a whole number of TILE-key
tiles and of cache blocks; matmul row counts are padded to ROW_MULTIPLE.
Work is grouped for speed only: decodes of similar length share one set of
ops, so do short prefill chunks (each padded to the longest one's tokens: a
padded token repeats its sequence's last one and is dropped), and a long
prefill chunk is folded a few hundred rows at a time (`step`), each step
reading only the tiles up to its last position. The grouping never changes
the bits, which is why it can follow a memory budget: a row's scores are dots
over head_dim, its P @ V products have the fixed reduction length TILE, and
every matmul's row count is a multiple of ROW_MULTIPLE whatever the group
(MKL then gives each row the same bits for any row or batch count).

A sliding window W is part of the plan: a row at position p sees keys
p - W < k <= p. Each group reads the key chunks from the one holding the
earliest key any of its rows sees (chunks wholly before every window are
never gathered), V is zeroed at the slots before each sequence's earliest
window start as at those past its end (they may never have been written),
a decode's mask hides both, and each step records its earliest key
(`first_key`), from which the fold knows its first chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from pagoda.kernels.kv_cache import slots_past_end, window_blocks
from pagoda.kernels.metadata import AttentionMetadata

TILE = 64  # key positions per tile: the fixed reduction length of every P @ V product
CHUNK = 1024  # key positions per chunk (rounded up to whole tiles and blocks): the online-softmax step
ROW_MULTIPLE = 4  # matmul row counts are padded to a multiple of this (MKL rounds 1-3 row pieces apart)
# elements per step in the score tensor and in the gathered K (and V) chunk: working sets of a
# few MB stay in cache and are reused, instead of page-faulting fresh memory every call
SCORE_BUDGET = 1 << 20
KV_BUDGET = 1 << 20


@dataclass
class KeyChunk:
    """Key positions [start, start + length) of N sequences, read as whole cache blocks."""

    start: int
    length: int  # whole tiles and blocks
    blocks: Tensor  # [N * length // block_size] int64 cache blocks, sequence by sequence
    # slots at or past a sequence's end, or before its earliest window start (None if there are none), which
    # hold other data or nothing (NaN):
    past_end: Tensor | None  # [P] int64 indices into the chunk's N * length slots: V is zeroed there after the read
    hidden: Tensor | None  # [N, 1, length] bool: True at those slots (a decode's mask, also over a NaN score)


@dataclass
class RowSet:
    """Query rows folded together: decodes of similar length (rows = G heads each), short chunks, or one chunk."""

    seqs: list[int]
    tokens: Tensor | slice  # [N * num_tokens] the rows' tokens in the flat token axis (a slice when contiguous)
    num_tokens: int  # per sequence: 1 for decodes, the (longest) chunk's length otherwise
    rows: int  # per sequence: num_tokens * G padded to ROW_MULTIPLE
    row_pos: Tensor  # [N, rows] int64 position of each row; padded rows repeat the last one
    last_pos: list[int]  # per step of `step` rows: the largest position in it
    step: int
    chunks: list[KeyChunk]  # from the chunk holding the earliest key a row sees
    first_key: list[int]  # per step: the earliest key any of its rows sees (0 without a sliding window)
    window: int  # the sliding window, 0 for none
    # grouped chunks of unequal length: (src [K] indices into the N * num_tokens padded tokens, dst [K] their
    # tokens in the flat axis) for the K real ones; None when every padded token is real
    real: tuple[Tensor, Tensor] | None = None


@dataclass
class AttentionPlan:
    """What a step's attention reads, from its metadata alone: built once, used by every layer."""

    meta: AttentionMetadata
    key: tuple  # cache geometry and module constants the plan was built for
    row_sets: list[RowSet]

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int, num_kv_heads: int, group: int, dim: int,
              sliding_window: int = 0) -> AttentionPlan:
        """Group the step's sequences and list the blocks each group reads (sliding_window W: the last W keys)."""
        unit = math.lcm(TILE, block_size)  # key spans are whole tiles and whole blocks
        chunk = round_up(CHUNK, unit)
        starts, seq_lens = meta.query_starts_cpu, meta.seq_lens_cpu
        window = sliding_window
        # the earliest key position p sees
        seen_from = (lambda p: max(0, p - window + 1)) if window > 0 else (lambda p: 0)  # noqa: E731
        decodes = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
        # per key of a chunk, a decode holds KVH * rows scores and KVH * D gathered values of K (and V)
        rows = round_up(group, ROW_MULTIPLE)
        max_keys = min(SCORE_BUDGET // (num_kv_heads * rows), KV_BUDGET // (num_kv_heads * dim))
        row_sets = []
        for seqs in _decode_groups(decodes, seq_lens, chunk, max_keys):
            lens = [seq_lens[b] for b in seqs]
            tokens = [starts[b] for b in seqs]
            contiguous = tokens == list(range(tokens[0], tokens[0] + len(tokens)))
            row_pos = (torch.tensor(lens, dtype=torch.int64)[:, None] - 1).expand(len(seqs), rows)
            firsts = [seen_from(n - 1) for n in lens]
            row_sets.append(RowSet(
                seqs, slice(tokens[0], tokens[0] + len(tokens)) if contiguous else torch.tensor(tokens),
                1, rows, row_pos, [max(lens) - 1], rows,
                _key_chunks(meta, seqs, lens, firsts, chunk, block_size, unit), [min(firsts)], window,
            ))  # fmt: skip
        # rows per step of a long chunk: bound the score tensor [KVH, rows, chunk] by SCORE_BUDGET
        step = max(ROW_MULTIPLE, SCORE_BUDGET // (num_kv_heads * chunk) // ROW_MULTIPLE * ROW_MULTIPLE)
        short, long = [], []
        for b, qlen in enumerate(meta.query_lens_cpu):
            if qlen > 1:  # a chunk within one key chunk and one step is folded once: it can share the fold
                fits = round_up(seq_lens[b], unit) <= chunk and round_up(qlen * group, ROW_MULTIPLE) <= step
                (short if fits else long).append(b)
        for seqs in _chunk_groups(short, meta.query_lens_cpu, seq_lens, group, unit, num_kv_heads, dim):
            row_sets.append(_chunk_row_set(meta, seqs, group, chunk, block_size, unit, window, seen_from))
        for b in long:
            qlen, seq_len = meta.query_lens_cpu[b], seq_lens[b]
            rows = round_up(qlen * group, ROW_MULTIPLE)
            pos = [min(seq_len - qlen + r // group, seq_len - 1) for r in range(rows)]  # padded rows: the last
            last = [pos[min(rows, lo + step) - 1] for lo in range(0, rows, step)]
            first = [seen_from(pos[lo]) for lo in range(0, rows, step)]  # rows ascend by position
            row_sets.append(RowSet(
                [b], slice(starts[b], starts[b] + qlen), qlen, rows, torch.tensor([pos]), last, step,
                _key_chunks(meta, [b], [seq_len], first[:1], chunk, block_size, unit), first, window,
            ))  # fmt: skip
        return cls(meta, _plan_key(block_size, num_kv_heads, group, dim, window), row_sets)

    def fits(self, meta: AttentionMetadata, block_size: int, num_kv_heads: int, group: int, dim: int,
             sliding_window: int = 0) -> bool:
        """Whether this plan was built for this step, this geometry and this window."""
        return self.meta is meta and self.key == _plan_key(block_size, num_kv_heads, group, dim, sliding_window)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def _plan_key(*geometry: int) -> tuple:
    return (*geometry, TILE, CHUNK, ROW_MULTIPLE, SCORE_BUDGET, KV_BUDGET)


def _key_chunks(meta, seqs, lens, firsts, chunk, block_size, unit) -> list[KeyChunk]:
    """The key chunks N sequences read: from the one holding the earliest of their first keys `firsts`
    (0 without a window) to the longest one's end, in whole tiles and blocks."""
    end = round_up(max(lens), unit)
    tables = meta.block_tables[seqs].to(torch.int64)  # [N, max_blocks]
    chunks = []
    for start in range(min(firsts) // chunk * chunk, end, chunk):
        length = min(chunk, end - start)
        past_end = None
        hidden = slots_past_end(lens, start, length)  # [N, length] or None
        if max(firsts) > start:  # slots before a sequence's earliest window start are never read
            before = torch.arange(start, start + length)[None, :] < torch.tensor(firsts)[:, None]
            hidden = before if hidden is None else hidden | before
        if hidden is not None:
            past_end = hidden.flatten().nonzero().flatten()
            hidden = hidden[:, None, :]
        chunks.append(KeyChunk(start, length, window_blocks(tables, start, length, block_size), past_end, hidden))
    return chunks


def _chunk_row_set(meta, seqs: list[int], group: int, chunk: int, block_size: int, unit: int, window: int,
                   seen_from) -> RowSet:
    """One fold for short chunks of N sequences, each padded to the longest chunk's tokens (and rows)."""
    qlens = [meta.query_lens_cpu[b] for b in seqs]
    lens = [meta.seq_lens_cpu[b] for b in seqs]
    starts = [meta.query_starts_cpu[b] for b in seqs]
    qmax = max(qlens)
    rows = round_up(qmax * group, ROW_MULTIPLE)
    # row r of sequence n is its token r // G; tokens past its chunk repeat its last one (rows dropped)
    pos = [[min(s - q + r // group, s - 1) for r in range(rows)] for q, s in zip(qlens, lens)]
    tokens = [start + min(t, q - 1) for start, q in zip(starts, qlens) for t in range(qmax)]
    real = None
    if min(qlens) < qmax:  # padded tokens: only the real ones are written out
        src = [n * qmax + t for n, q in enumerate(qlens) for t in range(q)]
        real = (torch.tensor(src), torch.tensor([tokens[i] for i in src]))
    contiguous = tokens == list(range(tokens[0], tokens[0] + len(tokens)))
    firsts = [seen_from(s - q) for q, s in zip(qlens, lens)]  # each chunk's first token sees the earliest key
    return RowSet(
        seqs, slice(tokens[0], tokens[0] + len(tokens)) if contiguous else torch.tensor(tokens), qmax, rows,
        torch.tensor(pos), [max(lens) - 1], rows, _key_chunks(meta, seqs, lens, firsts, chunk, block_size, unit),
        [min(firsts)], window, real,
    )  # fmt: skip


def _chunk_groups(chunks: list[int], qlens: list[int], seq_lens: list[int], group: int, unit: int,
                  num_kv_heads: int, dim: int) -> list[list[int]]:
    """Split short chunks, sorted by length, into groups whose one fold fits SCORE_BUDGET and KV_BUDGET."""
    groups: list[list[int]] = []
    current: list[int] = []
    for b in sorted(chunks, key=lambda b: qlens[b]):  # stable: equal chunks stay in order, often contiguous
        grown = current + [b]
        rows = round_up(max(qlens[c] for c in grown) * group, ROW_MULTIPLE)  # the longest so far: sorted
        keys = max(round_up(seq_lens[c], unit) for c in grown)
        if current and (num_kv_heads * len(grown) * rows * keys > SCORE_BUDGET
                        or len(grown) * keys * num_kv_heads * dim > KV_BUDGET):
            groups.append(current)
            grown = [b]
        current = grown
    if current:
        groups.append(current)
    return groups


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
