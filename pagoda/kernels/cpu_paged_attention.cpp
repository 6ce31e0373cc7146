// Causal paged attention for x86 CPUs with AVX2 and FMA, float32 throughout, and the KV write before it.
//
// Batch invariance by construction: the output of (token, head) is one fixed sequence of operations
// over that token's own context, keys lo..pos in order (lo = 0, or pos - W + 1 with a sliding window W):
//   s[j] = dot(q, k[j]) * scale                       (8-lane FMA over head_dim, then a fixed tree over lanes)
//   s[j] = c * tanh(s[j] / c)                         (soft-capping c only; scalar std::tanh per score)
//   m = max_j s[j]                                    (exact, order free)
//   p[j] = exp(s[j] - m), l = sum_j p[j]              (8 keys a vector, vectors at absolute multiples of 8
//                                                      from the one holding lo, in order; lanes outside
//                                                      lo..pos are exact zeros)
//   out = (sum_j p[j] v[j]) / l                       (FMA over j = lo..pos in order, 8 lanes of head_dim a vector)
// Nothing depends on the other tokens of the step, on where the token sits in it, on how many threads
// run, or on whether the token is decoded alone or recomputed inside a prefill chunk: it reads the same
// keys at the same positions and does the same arithmetic (lo and the vectors' alignment follow from its
// own position and window). exp is this file's own polynomial (the same code for every lane), not a
// library call that may take another path for a scalar tail. Keys before the earliest window start of a
// tile are never read.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "cpu_simd.h"
#include "cpu_step.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using pagoda_simd::exp_nonpositive;
using pagoda_simd::hsum;

constexpr int kMaxVectors = 32;  // head_dim up to 256

// Eight 8-lane vectors -> one vector whose lane i is the sum of a[i]'s lanes, by a fixed tree: a key's
// score depends on its own products only, whichever seven keys share its group.
inline __m256 sum_lanes8(const __m256 a[8]) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // lanes: s0123 = [a0lo a1lo a2lo a3lo | a0hi a1hi a2hi a3hi], likewise s4567
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

struct Shapes {
  int64_t heads, kv_heads, dim, block_size, table_width, kv_block_stride, kv_row_stride;
};

constexpr int64_t kTileTokens = 4;  // consecutive tokens of one sequence that share each key and value load
constexpr int64_t kValueChunk = 64;  // keys whose values stay in L1 while every row of a tile folds them in

// A tile: tokens t0..t0+n-1 of one sequence (positions pos0..pos0+n-1), one kv head, all its query heads.
using Tile = pagoda_step::AttentionTile;

struct Scratch {
  std::vector<const float*> keys, values;  // the context's rows for the kv head, padded to 8 with `zeros`
  std::vector<float> scores, acc, zeros;
};

// Each row (token, query head) of the tile gets exactly the arithmetic it would get alone (the file's
// note): the tile only orders the loops so that a key or value row read once serves every row.
void attend(const float* q, const float* k_cache, const float* v_cache, const int32_t* table, const Tile& tile,
            int64_t group, float scale, int64_t window, float softcap, const Shapes& s, Scratch& w, float* out) {
  const int64_t last = tile.pos0 + tile.n - 1, padded = (last + 8) / 8 * 8, vectors = s.dim / 8;
  const int64_t rows = tile.n * group;
  auto row_q = [&](int64_t r) { return q + ((tile.t0 + r / group) * s.heads + tile.kv_head * group + r % group) * s.dim; };
  auto row_pos = [&](int64_t r) { return tile.pos0 + r / group; };
  auto row_lo = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, row_pos(r) - window + 1) : int64_t{0}; };
  // keys [first, last] are read (the tile's first row has the earliest window); scratch starts at the
  // vector holding `first`: index j - base is absolute key j
  const int64_t first = row_lo(0), base = first / 8 * 8, span = padded - base;
  w.keys.resize(span);
  w.values.resize(span);
  w.zeros.assign(s.dim, 0.0f);
  for (int64_t j = base; j < first; ++j) w.keys[j - base] = w.values[j - base] = w.zeros.data();
  for (int64_t b = first / s.block_size, j = first; j <= last; ++b) {
    const float* kb = k_cache + static_cast<int64_t>(table[b]) * s.kv_block_stride + tile.kv_head * s.dim;
    const float* vb = v_cache + static_cast<int64_t>(table[b]) * s.kv_block_stride + tile.kv_head * s.dim;
    for (int64_t o = j % s.block_size; o < s.block_size && j <= last; ++o, ++j) {
      w.keys[j - base] = kb + o * s.kv_row_stride;
      w.values[j - base] = vb + o * s.kv_row_stride;
    }
  }
  for (int64_t j = last + 1; j < padded; ++j) w.keys[j - base] = w.values[j - base] = w.zeros.data();
  w.scores.resize(rows * span);
  w.acc.assign(rows * s.dim, 0.0f);
  const __m256 sv = _mm256_set1_ps(scale);
  // s[j] = sum(q * k[j]) * scale, eight keys at a time, for the vectors that hold some of a row's keys
  for (int64_t j = base; j < padded; j += 8) {
    for (int64_t r = 0; r < rows; ++r) {
      if (j > row_pos(r) || j + 8 <= row_lo(r)) continue;
      const float* qh = row_q(r);
      const float* const* keys = w.keys.data() + (j - base);
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_loadu_ps(keys[i]));
      for (int64_t v = 1; v < vectors; ++v) {
        const __m256 qv = _mm256_loadu_ps(qh + 8 * v);
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[i] + 8 * v), acc[i]);
      }
      _mm256_storeu_ps(w.scores.data() + r * span + (j - base), _mm256_mul_ps(sum_lanes8(acc), sv));
    }
  }
  // p[j] = exp(s[j] - max), l = sum p, over each row's own keys lo..pos (its vectors padded with exact zeros)
  std::vector<float> sums(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* sc = w.scores.data() + r * span;  // sc[j]: key base + j
    // relative to base (a multiple of 8): keys [lo, keys) are the row's, vectors [start, mine) hold them
    const int64_t lo = row_lo(r) - base, keys = row_pos(r) + 1 - base, start = lo / 8 * 8, mine = (keys + 7) / 8 * 8;
    if (softcap > 0.0f)
      for (int64_t j = lo; j < keys; ++j) sc[j] = softcap * std::tanh(sc[j] / softcap);
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = lo; j < keys; ++j) m = std::max(m, sc[j]);
    for (int64_t j = start; j < lo; ++j) sc[j] = -std::numeric_limits<float>::infinity();  // exp -> 0
    for (int64_t j = keys; j < mine; ++j) sc[j] = -std::numeric_limits<float>::infinity();
    const __m256 mv = _mm256_set1_ps(m);
    __m256 lsum = _mm256_setzero_ps();
    for (int64_t j = start; j < mine; j += 8) {
      const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv));
      _mm256_storeu_ps(sc + j, p);
      lsum = _mm256_add_ps(lsum, p);
    }
    sums[r] = hsum(lsum);
  }
  // out = (sum_j p[j] v[j]) / l, keys lo..pos in order; a row's partial sums wait in `acc` between chunks
  for (int64_t c = first / kValueChunk * kValueChunk; c <= last; c += kValueChunk) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t begin = std::max(c, row_lo(r)), end = std::min(row_pos(r) + 1, c + kValueChunk);
      if (end <= begin) continue;
      const float* sc = w.scores.data() + r * span;
      float* ar = w.acc.data() + r * s.dim;
      __m256 acc[kMaxVectors];
      for (int64_t v = 0; v < vectors; ++v) acc[v] = _mm256_loadu_ps(ar + 8 * v);
      for (int64_t j = begin - base; j < end - base; ++j) {
        const float* vrow = w.values[j];
        const __m256 p = _mm256_set1_ps(sc[j]);
        for (int64_t v = 0; v < vectors; ++v) acc[v] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vrow + 8 * v), acc[v]);
      }
      for (int64_t v = 0; v < vectors; ++v) _mm256_storeu_ps(ar + 8 * v, acc[v]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 l = _mm256_set1_ps(sums[r]);
    const float* ar = w.acc.data() + r * s.dim;
    float* o = out + ((tile.t0 + r / group) * s.heads + tile.kv_head * group + r % group) * s.dim;
    for (int64_t v = 0; v < vectors; ++v) _mm256_storeu_ps(o + 8 * v, _mm256_div_ps(_mm256_loadu_ps(ar + 8 * v), l));
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t sliding_window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be [T, H, D] float32, contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "k_cache and v_cache must be [blocks, block_size, KVH, D] float32, contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be [B, W] int32");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.numel() == seq_lens.numel() + 1 && seq_lens.numel() == block_tables.size(0),
              "query_start_loc [B+1] and seq_lens [B] must be int32");
  const Shapes s{q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_tables.size(1),
                 k_cache.size(1) * k_cache.size(2) * k_cache.size(3), k_cache.size(2) * k_cache.size(3)};
  TORCH_CHECK(k_cache.size(3) == s.dim && s.dim % 8 == 0 && s.dim / 8 <= kMaxVectors,
              "head_dim must be a multiple of 8, at most 256, and the same in q and the cache");
  TORCH_CHECK(s.heads % s.kv_heads == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(sliding_window >= 0 && softcap >= 0.0, "sliding_window and softcap must be >= 0 (0: none)");
  const int64_t num_seqs = seq_lens.numel(), tokens = q.size(0);
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[num_seqs] == tokens, "query_start_loc must end at the number of tokens");
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t qlen = starts[b + 1] - starts[b], first = lens[b] - qlen;
    TORCH_CHECK(qlen >= 0 && first >= 0 && (lens[b] + s.block_size - 1) / s.block_size <= s.table_width,
                "sequence ", b, ": its lengths and block table disagree");
  }
  at::Tensor out = at::empty_like(q);
  const pagoda_step::AttentionArgs args{q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                                        block_tables.data_ptr<int32_t>(), starts, lens, num_seqs, s.heads,
                                        s.kv_heads, s.dim, s.block_size, s.table_width, static_cast<float>(scale),
                                        sliding_window, static_cast<float>(softcap), out.data_ptr<float>()};
  const std::vector<Tile> tiles = pagoda_step::attention_tiles(args);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t i0, int64_t i1) {
    pagoda_step::attend_tiles(args, tiles, i0, i1);
  });
  return out;
}

// The new tokens' K and V [T, KVH, D] (any strides along T and KVH: views into the qkv projection) into
// their cache slots [T]: one copy of a token's row each, where torch takes a conversion and a scatter.
void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat,
              "k_cache and v_cache must be [blocks, block_size, KVH, D] float32, contiguous");
  TORCH_CHECK(k.dim() == 3 && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.sizes() == v.sizes() &&
                  k.stride(2) == 1 && v.stride(2) == 1 && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "k and v must be [T, KVH, D] float32 fitting the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == k.size(0), "slot_mapping must be [T] int64");
  const int64_t heads = k.size(1), dim = k.size(2), slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < slots, "slot ", sp[t], " is outside the cache");
  pagoda_step::write_kv_tokens(k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), heads, dim, k.data_ptr<float>(),
                               k.stride(0), k.stride(1), v.data_ptr<float>(), v.stride(0), v.stride(1), sp, 0,
                               k.size(0));
}

}  // namespace

namespace pagoda_step {

std::vector<AttentionTile> attention_tiles(const AttentionArgs& a) {
  std::vector<AttentionTile> tiles;
  for (int64_t b = 0; b < a.num_seqs; ++b) {
    const int64_t qlen = a.starts[b + 1] - a.starts[b], first = a.lens[b] - qlen;
    for (int64_t i = 0; i < qlen; i += kTileTokens)
      for (int64_t g = 0; g < a.kv_heads; ++g)
        tiles.push_back({b, a.starts[b] + i, std::min(kTileTokens, qlen - i), first + i, g});
  }
  return tiles;
}

// Tiles [i0, i1) of the order that takes them alternately from both ends (a prefill's short contexts, then
// its long ones), so that contiguous shares carry about the same work.
void attend_tiles(const AttentionArgs& a, const std::vector<AttentionTile>& tiles, int64_t i0, int64_t i1) {
  const Shapes s{a.heads, a.kv_heads, a.dim, a.block_size, a.table_width, a.block_size * a.kv_heads * a.dim,
                 a.kv_heads * a.dim};
  const int64_t count = static_cast<int64_t>(tiles.size()), group = a.heads / a.kv_heads;
  Scratch scratch;
  for (int64_t i = i0; i < i1; ++i) {
    const Tile& tile = tiles[i % 2 == 0 ? i / 2 : count - 1 - i / 2];
    attend(a.q, a.k_cache, a.v_cache, a.tables + tile.seq * a.table_width, tile, group, a.scale, a.window, a.softcap,
           s, scratch, a.out);
  }
}

void write_kv_tokens(float* kc, float* vc, int64_t heads, int64_t dim, const float* k, int64_t ks0, int64_t ks1,
                     const float* v, int64_t vs0, int64_t vs1, const int64_t* slots, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kc + (slots[t] * heads + h) * dim, k + t * ks0 + h * ks1, dim * 4);
      std::memcpy(vc + (slots[t] * heads + h) * dim, v + t * vs0 + h * vs1, dim * 4);
    }
}

}  // namespace pagoda_step

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()", &write_kv);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale, int sliding_window=0, float softcap=0.) -> Tensor", &paged_attention);
}
