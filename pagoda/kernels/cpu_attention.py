"""Batch-invariant paged attention for the CPU, in vectorized torch: the fold over key chunks.

Design note. A query row (sequence, position) must get the same bits whether
it is decoded alone, decoded beside other sequences, or recomputed inside a
prefill chunk of any length at any offset. Every step below is chosen so that
the arithmetic done for one row depends only on that row's query and context:

* Keys are folded in chunks of CHUNK absolute positions (chunk c holds
  positions [c*CHUNK, (c+1)*CHUNK) whatever the batch), in order, by an online
  softmax. A row sees keys 0..pos; the rest are masked to -inf. Chunk 0 sets a
  row's running state; a later chunk wholly after a row leaves its max
  unchanged, so alpha = exp(0) = 1 and it adds exact zeros: folding it in, or
  skipping it, is a bitwise no-op.
* Within a chunk, keys form tiles of TILE positions. Scores are q @ k^T with
  the reduction over head_dim only; P @ V is one matmul per tile, so its
  reduction length is always TILE. MKL sgemm computes a row differently when
  it falls in a piece of 1-3 rows (measured: matrices of 1-3 rows always; 5-7,
  9-11, 17-19... rows when threads split them), so every matmul gets a
  multiple of ROW_MULTIPLE rows, query rows being zero-padded. With that, an
  element's bits did not depend on the other rows or columns, for 1 to 32 threads.
* The chunk's max is exact (a max is order free); probabilities are summed
  within each tile (fixed length TILE), and tile partials by a halving tree
  (tile i + tile i + h, h the largest power of two below the count). That tree
  equals the one over the tile count zero-padded to any power of two, so a
  chunk cut short in one batch and not in another gives the same bits.
  torch.exp is used, not the faster exp2, whose vector and scalar-tail code
  disagree in the last bit on this build.
* A sliding window W hides keys at or before pos - W as well, and soft-capping
  c replaces a score s by c * tanh(s / c) (torch.tanh: on the CI machine its
  vector and scalar-tail code agree at every offset and length measured, like
  torch.exp). A row may then see nothing in a chunk, and a step's first chunk
  (the one holding its earliest key) may lie before a row's window: its max
  stays -inf there, and the fold subtracts 0 instead (exp(-inf - 0) = 0, so
  alpha and the weights are 0, never NaN); the state stays exact zeros until
  the row's first key. Where no window is set none of this runs and the ops
  are the ones above.

Which rows are folded together, and which blocks each group reads, is the
step's `AttentionPlan` (`cpu_plan.py`, where the sizes above are set): the
grouping is for speed only and never changes the bits. The tests check all of
this with torch.equal, with several chunks per context.
"""

from __future__ import annotations

import torch
from torch import Tensor

import pagoda.kernels.cpu_native as cpu_native
from pagoda.kernels.cpu_plan import TILE, AttentionPlan, KeyChunk, RowSet, round_up
from pagoda.kernels.kv_cache import gather_blocks, write_kv
from pagoda.kernels.metadata import AttentionMetadata
from pagoda.kernels.workspace import Workspace

MIN_COLS = 16  # P @ V products get at least this many columns (MKL has a few-column path)


def cpu_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    workspace: Workspace | None = None,
    out: Tensor | None = None,
    plan: AttentionPlan | None = None,
    *,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """q [T, H, D] -> out [T, H, D]; causal paged attention (the last sliding_window keys if > 0, scores
    soft-capped if softcap > 0), bitwise batch invariant per row. A given plan must be built for the window."""
    ws = workspace or Workspace()
    out = torch.empty_like(q) if out is None else out
    num_kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    if plan is None:
        plan = AttentionPlan.build(meta, k_cache.shape[1], num_kv_heads, group, dim, sliding_window)
    for rs in plan.row_sets:
        n, qlen = len(rs.seqs), rs.num_tokens
        # rows of kv head h: (token t, query head h * G + g) at row t * G + g, zero-padded to rs.rows
        q_rows = ws.get("q_rows", (num_kv_heads, n, rs.rows, dim))
        if rs.rows > qlen * group:
            q_rows[:, :, qlen * group :].zero_()
        src = q[rs.tokens].view(n, qlen, num_kv_heads, group, dim).permute(2, 0, 1, 3, 4).float()
        torch.mul(src, scale, out=q_rows[:, :, : qlen * group].view(num_kv_heads, n, qlen, group, dim))
        numer, denom = _attend_rows(q_rows, rs, k_cache, v_cache, ws, softcap)  # [KVH, N, R, D], [KVH, N, R, 1]
        numer = numer[:, :, : qlen * group].view(num_kv_heads, n, qlen, group, dim)
        denom = denom[:, :, : qlen * group].view(num_kv_heads, n, qlen, group, 1)
        if isinstance(rs.tokens, slice):  # divide straight into out's rows, in its dtype
            torch.div(numer, denom, out=out[rs.tokens].view(n, qlen, num_kv_heads, group, dim).permute(2, 0, 1, 3, 4))
            continue
        rows = (numer / denom).permute(1, 2, 0, 3, 4).reshape(n * qlen, -1, dim).to(out.dtype)  # [N * qlen, H, D]
        if rs.real is None:
            out[rs.tokens] = rows
        else:  # short chunks padded to the longest: write the real tokens only
            out.index_copy_(0, rs.real[1], rows.index_select(0, rs.real[0]))
    return out


def _attend_rows(q: Tensor, rs: RowSet, k_cache: Tensor, v_cache: Tensor, ws: Workspace,
                 softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """q [KVH, N, R, D] (scaled) -> softmax-weighted V [KVH, N, R, D] and its weight sum [KVH, N, R, 1].

    Chunk c holds keys [c * chunk, (c + 1) * chunk) whatever the batch, and chunks are folded in
    order. A chunk wholly after a row's position leaves it exactly unchanged (alpha = exp(0) = 1,
    nothing added), so the row's bits depend only on the chunks it sees. With a sliding window, a
    chunk wholly before a row's window leaves its state at exact zeros (max -inf, alpha 0).
    """
    num_kv_heads, n, rows, dim = q.shape
    if len(rs.chunks) == 1 and rs.step >= rows:  # one fold: its result is the answer
        kc = rs.chunks[0]
        k, v = gather_blocks(k_cache, v_cache, kc.blocks, n, kc.past_end, ws, zero_keys=False)
        keys = min(kc.length, round_up(rs.last_pos[0] + 1 - kc.start, TILE))
        numer, denom, _, _ = _fold_chunk(q, rs, 0, rows, k[:, :keys], v[:, :keys], kc, ws, None, softcap)
        return numer, denom
    numer = ws.get("numer", (num_kv_heads, n, rows, dim))
    denom = ws.get("denom", (num_kv_heads, n, rows, 1))
    row_max = ws.get("row_max", (num_kv_heads, n, rows, 1))
    for kc in rs.chunks:
        k, v = gather_blocks(k_cache, v_cache, kc.blocks, n, kc.past_end, ws, zero_keys=False)
        for i, lo in enumerate(range(0, rows, rs.step)):
            hi = min(rows, lo + rs.step)
            if rs.last_pos[i] < kc.start or rs.first_key[i] >= kc.start + kc.length:
                continue  # every row of the step is before this chunk, or the chunk before every window: a no-op
            keys = min(kc.length, round_up(rs.last_pos[i] + 1 - kc.start, TILE))  # tiles after every row: no-ops
            first = kc.start <= rs.first_key[i]  # the step's first chunk (chunk 0 without a window)
            m = None if first else row_max[:, :, lo:hi]
            c_numer, c_denom, c_max, c_sub = _fold_chunk(q, rs, lo, hi, k[:, :keys], v[:, :keys], kc, ws, m, softcap)
            if first:  # it sets the step's state (a row whose window starts later: zeros and max -inf)
                numer[:, :, lo:hi].copy_(c_numer)
                denom[:, :, lo:hi].copy_(c_denom)
                row_max[:, :, lo:hi].copy_(c_max)
                continue
            # exactly 1 for a row that sees nothing new, 0 for a row that has seen nothing yet
            alpha = torch.exp(row_max[:, :, lo:hi] - c_sub)
            denom[:, :, lo:hi].mul_(alpha).add_(c_denom)
            numer[:, :, lo:hi].mul_(alpha).add_(c_numer)
            row_max[:, :, lo:hi].copy_(c_max)
    return numer, denom


def _fold_chunk(q, rs, lo, hi, k, v, kc: KeyChunk, ws, row_max=None,
                softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Rows lo:hi against the first L keys of chunk kc (k/v [N, L, KVH, D]).

    Returns the chunk's (weighted V [KVH, N, r, D], weight sum [KVH, N, r, 1], max [KVH, N, r, 1], and
    the max the weights are taken relative to [KVH, N, r, 1]): max(row_max, the chunk's max), where a row
    that has seen no key yet (-inf, only with a sliding window) takes 0; row_max None means the first chunk.
    """
    num_kv_heads, n, _, dim = q.shape
    rows, length = hi - lo, k.shape[1]
    tiles = length // TILE
    scores = ws.get("scores", (num_kv_heads, n, rows, length))
    if n == 1:  # one product batched over kv heads: k[0].permute(1, 2, 0) is a strided view [KVH, D, L]
        torch.bmm(q[:, 0, lo:hi], k[0].permute(1, 2, 0), out=scores.view(num_kv_heads, rows, length))
    else:  # per kv head, k.unbind(2)[h] is a strided view [N, L, D]: no copy of K per head
        for q_h, k_h, s_h in zip(q[:, :, lo:hi].unbind(0), k.unbind(2), scores.unbind(0)):
            torch.bmm(q_h, k_h.transpose(1, 2), out=s_h)  # one dot over D per element
    if softcap > 0:  # c * tanh(s / c), elementwise: the same bits wherever the score sits
        scores.div_(softcap).tanh_().mul_(softcap)
    if rs.num_tokens > 1:  # causal: row r sees keys up to its position (and after pos - W with a window)
        key_pos, row_pos = torch.arange(kc.start, kc.start + length)[None, None, :], rs.row_pos[:, lo:hi, None]
        hidden = key_pos > row_pos
        if rs.window:
            hidden |= key_pos <= row_pos - rs.window
        scores.masked_fill_(hidden, float("-inf"))
    elif kc.hidden is not None:  # a decode sees its context (or window): slots past its end or before it hidden
        scores.masked_fill_(kc.hidden[:, :, :length], float("-inf"))  # also over the NaN of an unzeroed K slot
    new_max = scores.amax(dim=-1, keepdim=True)  # exact, order free; finite in chunk 0 without a window
    if row_max is not None:
        new_max = torch.maximum(row_max, new_max)
    sub = new_max
    if rs.window:  # a row that has seen no key yet subtracts 0: exp(-inf - 0) = 0, never NaN
        sub = new_max.masked_fill(new_max == float("-inf"), 0.0)
    probs = scores.sub_(sub).exp_()  # hidden -> 0
    sums = probs.view(num_kv_heads, n, rows, tiles, TILE).sum(dim=-1)  # [KVH, N, r, tiles]
    if dim < MIN_COLS:  # keep P @ V off MKL's few-column path
        v = torch.nn.functional.pad(v, (0, MIN_COLS - dim))
    cols = v.shape[-1]
    probs_t = ws.get("probs_t", (num_kv_heads, n, tiles, rows, TILE))
    probs_t.copy_(probs.view(num_kv_heads, n, rows, tiles, TILE).transpose(2, 3))
    parts = ws.get("parts", (num_kv_heads, n * tiles, rows, cols))
    for p_h, v_h, o_h in zip(probs_t.unbind(0), v.unbind(2), parts.unbind(0)):
        # [N * tiles, r, TILE] @ [N * tiles, TILE, cols]: every reduction is TILE long
        torch.bmm(p_h.view(n * tiles, rows, TILE), v_h.reshape(n * tiles, TILE, cols), out=o_h)
    numer = _halving_sum_(parts.view(num_kv_heads, n, tiles, rows, cols), 2)[..., :dim]
    return numer, _halving_sum_(sums, 3)[..., None], new_max, sub


def _halving_sum_(x: Tensor, dim: int) -> Tensor:
    """Sum over `dim` in place, adding entry i + h into entry i (h the largest power of two below the count).

    Equal to the same tree over `dim` zero-padded to any power of two, so trailing all-zero
    entries never change the bits. Returns the sum (entry 0, `dim` dropped); x is overwritten.
    """
    count = x.shape[dim]
    while count > 1:
        half = 1 << ((count - 1).bit_length() - 1)
        x.narrow(dim, 0, count - half).add_(x.narrow(dim, half, count - half))
        count = half
    return x.select(dim, 0)


class CpuBackend:
    """AttentionBackend for the CPU, bitwise batch invariant: pagoda's C++ kernel (cpu_native) for float32
    where it builds, else the torch fold above (see the design notes)."""

    name = "cpu"

    def __init__(self, native: bool | None = None) -> None:
        self.native = cpu_native.available() and native is not False  # native=False: the torch fold (tests)
        self.workspace = Workspace()  # scratch reused across steps; one backend serves one runner thread
        self.plan: AttentionPlan | None = None  # the current step's, shared by its layers
        self.plans: dict[int, AttentionPlan] = {}  # the current step's per sliding window (layers may alternate)

    def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """Store new K/V through slot_mapping."""
        if self.native and k_cache.dtype == k.dtype == v.dtype == torch.float32 and k.stride(-1) == v.stride(-1) == 1:
            cpu_native.write_kv(k_cache, v_cache, k, v, slot_mapping)
        else:
            write_kv(k_cache, v_cache, k, v, slot_mapping)

    def attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float, *,
        sliding_window: int = 0, softcap: float = 0.0,
    ) -> Tensor:  # fmt: skip
        """Causal attention of the new tokens over their cached context (windowed, soft-capped if asked)."""
        if sliding_window < 0 or softcap < 0:
            raise ValueError(f"sliding_window and softcap must be >= 0 (0: none), got {sliding_window}, {softcap}")
        if self.native and q.dtype == k_cache.dtype == torch.float32 and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
            return cpu_native.paged_attention(q.contiguous(), k_cache, v_cache, meta.block_tables,
                                              meta.query_start_loc, meta.seq_lens, scale, sliding_window, softcap)
        geometry = (k_cache.shape[1], k_cache.shape[2], q.shape[1] // k_cache.shape[2], k_cache.shape[3])
        plan = self.plans.get(sliding_window)
        if plan is None or not plan.fits(meta, *geometry, sliding_window):
            self.plans = {w: p for w, p in self.plans.items() if p.meta is meta}  # drop an earlier step's
            plan = self.plans[sliding_window] = AttentionPlan.build(meta, *geometry, sliding_window)
        self.plan = plan
        return cpu_attention(q, k_cache, v_cache, meta, scale, self.workspace, plan=plan,
                             sliding_window=sliding_window, softcap=softcap)
