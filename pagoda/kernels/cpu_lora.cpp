// LoRA deltas of a step's rows, each row its own adapter's, in one call per projection (x86 CPUs with AVX2 and
// FMA): out[t] += (x[t] A^T) B^T for row t's adapter (rows of slot -1 add nothing).
//
// The grouped idea of punica / S-LoRA, for a CPU: rows of many adapters in one call, each reading its own
// adapter's weights. A step's adapters are named by a table of addresses (pagoda/model/lora.py's LoraTable):
// table [slots, projections, 3] int64 holds, per slot and projection, (segments' address, segment count, total
// rank); a segment is one part of a stacked projection (q of qkv, gate of gate_up) as int64 [5]: (A's address
// [r, K], B^T's address [r, cols], r, its first output column, cols). So a recorded step (cpu_graph.cpp)
// replays the same calls with whichever adapters the next step holds.
//
// Two phases, each split over the threads by units of work whose results never depend on the split:
//   down: xa[t, j] = A[j] . x[t] for each of the row's rank rows: hsum of fma over K in blocks of 8, the tail in
//         zero-padded vectors (four rows of A at a time: four independent chains, each the same sequence);
//   up:   out[t, c] += sum over j in order of xa[t, j] * Bt[j, c]: fma from zero over j, then one add, 64 columns
//         at a time (eight independent chains), the last columns through a padded vector.
// Every output element is one fixed instruction sequence over its own row's inputs and adapter: batch invariant
// by construction, whatever the other rows, their adapters, the row count or the thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "cpu_simd.h"
#include "cpu_step.h"

#include <algorithm>
#include <vector>

namespace {

struct Segment {
  const float* a;
  const float* bt;
  int64_t rank, offset, cols;
};

inline Segment segment(const int64_t* s) {
  return {reinterpret_cast<const float*>(s[0]), reinterpret_cast<const float*>(s[1]), s[2], s[3], s[4]};
}

// The row's (segments, count) for projection `linear`: count 0 for a base row or an adapter that leaves it alone.
inline const int64_t* row_entry(const int64_t* table, int64_t linear, int64_t linears, const int64_t* row_slot,
                                int64_t t) {
  static const int64_t none[3] = {0, 0, 0};
  return row_slot[t] < 0 ? none : table + (row_slot[t] * linears + linear) * 3;
}

// A tile: up to kTileRows rows of one slot, which share every load of their adapter's weights.
constexpr int kTileRows = 4;
struct Tile {
  int64_t row[kTileRows];
  int count;
  const int64_t* entry;
};

// The rows with an adapter for this projection, grouped by slot (in row order within a slot), cut into tiles.
std::vector<Tile> tiles_of(const int64_t* table, int64_t linear, int64_t linears, const int64_t* row_slot,
                           int64_t rows) {
  std::vector<Tile> tiles;
  std::vector<int64_t> order;
  order.reserve(rows);
  for (int64_t t = 0; t < rows; ++t)
    if (row_entry(table, linear, linears, row_slot, t)[1] > 0) order.push_back(t);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return row_slot[a] < row_slot[b]; });
  for (size_t i = 0; i < order.size();) {
    Tile tile{{}, 0, row_entry(table, linear, linears, row_slot, order[i])};
    const int64_t slot = row_slot[order[i]];
    while (i < order.size() && row_slot[order[i]] == slot && tile.count < kTileRows) tile.row[tile.count++] = order[i++];
    tiles.push_back(tile);
  }
  return tiles;
}

// xa[r][j] = A[j] . x[r] for R rows and J rank rows from j: hsum of fma over K in blocks of 8, the tail zero-padded.
// Every (r, j) is its own chain, the same sequence whatever R and J.
template <int R, int J>
void down_tile(const float* const* x, int64_t k, const float* a, int64_t j, float* const* xa) {
  const int64_t full = k / 8 * 8;
  __m256 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < J; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t i = 0; i < full; i += 8) {
    __m256 av[J];
    for (int m = 0; m < J; ++m) av[m] = _mm256_loadu_ps(a + (j + m) * k + i);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x[r] + i);
      for (int m = 0; m < J; ++m) acc[r][m] = _mm256_fmadd_ps(av[m], xv, acc[r][m]);
    }
  }
  if (full < k) {  // the tail in zero-padded vectors: the same instructions as a full block
    alignas(32) float pa[J][8] = {}, px[R][8] = {};
    for (int m = 0; m < J; ++m) std::copy(a + (j + m) * k + full, a + (j + m) * k + k, pa[m]);
    for (int r = 0; r < R; ++r) std::copy(x[r] + full, x[r] + k, px[r]);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < J; ++m)
        acc[r][m] = _mm256_fmadd_ps(_mm256_load_ps(pa[m]), _mm256_load_ps(px[r]), acc[r][m]);
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < J; ++m) xa[r][j + m] = pagoda_simd::hsum(acc[r][m]);
}

// Rank rows [j0, j1) of a tile of R rows, J at a time, one at a time at the end.
template <int R, int J>
void down_rows(const float* const* x, int64_t k, const float* a, int64_t j0, int64_t j1, float* const* xa) {
  int64_t j = j0;
  for (; j + J <= j1; j += J) down_tile<R, J>(x, k, a, j, xa);
  for (; j < j1; ++j) down_tile<R, 1>(x, k, a, j, xa);
}

// out[r][c] += sum over j in order of xa[r][j] * bt[j, c] for R rows and C column vectors from c: each (r, column)
// its own chain from zero over j, then one add, the same sequence whatever R and C.
template <int R, int C>
void up_tile(const float* const* xa, const float* bt, int64_t rank, int64_t n, int64_t c, float* const* out) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < C; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t j = 0; j < rank; ++j) {
    __m256 bv[C];
    for (int m = 0; m < C; ++m) bv[m] = _mm256_loadu_ps(bt + j * n + c + 8 * m);
    for (int r = 0; r < R; ++r) {
      const __m256 w = _mm256_set1_ps(xa[r][j]);
      for (int m = 0; m < C; ++m) acc[r][m] = _mm256_fmadd_ps(w, bv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < C; ++m)
      _mm256_storeu_ps(out[r] + c + 8 * m, _mm256_add_ps(_mm256_loadu_ps(out[r] + c + 8 * m), acc[r][m]));
}

// Columns [c0, c1) of a segment for a tile of R rows (c0 a multiple of 8): C vectors at a time, then one, then
// the last columns through a padded vector.
template <int R, int C>
void up_columns(const float* const* xa, const float* bt, int64_t rank, int64_t n, int64_t c0, int64_t c1,
                float* const* out) {
  int64_t c = c0;
  for (; c + 8 * C <= c1; c += 8 * C) up_tile<R, C>(xa, bt, rank, n, c, out);
  for (; c + 8 <= c1; c += 8) up_tile<R, 1>(xa, bt, rank, n, c, out);
  if (c < c1) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    alignas(32) float col[8] = {}, delta[8];
    for (int64_t j = 0; j < rank; ++j) {
      std::copy(bt + j * n + c, bt + j * n + c1, col);
      const __m256 bv = _mm256_load_ps(col);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(xa[r][j]), bv, acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(delta, acc[r]);
      for (int64_t i = c; i < c1; ++i) out[r][i] += delta[i - c];
    }
  }
}

constexpr int64_t kDownRanks = 8, kUpColumns = 64;  // a unit of work of each phase: rank rows, output columns

int64_t down_units(const Segment& s) { return (s.rank + kDownRanks - 1) / kDownRanks; }
int64_t up_units(const Segment& s) { return (s.cols + kUpColumns - 1) / kUpColumns; }

// Runs units [u0, u1) of a phase over the tiles: `per` counts a segment's units, `run(tile, segment, its first
// rank row in a row's xa, unit)` runs one; returns the units counted (all of them when u1 is past the end).
template <typename PerSegment, typename Run>
int64_t for_units(const std::vector<Tile>& tiles, int64_t u0, int64_t u1, PerSegment per, Run run) {
  int64_t first = 0;
  for (const Tile& tile : tiles) {
    int64_t base = 0;
    for (int64_t g = 0; g < tile.entry[1]; ++g) {
      const Segment s = segment(reinterpret_cast<const int64_t*>(tile.entry[0]) + 5 * g);
      const int64_t count = per(s);
      for (int64_t u = std::max(u0, first); u < std::min(u1, first + count); ++u) run(tile, s, base, u - first);
      first += count;
      base += s.rank;
    }
  }
  return first;
}

}  // namespace

namespace pagoda_step {

int64_t lora_units(const int64_t* table, int64_t linear, int64_t linears, const int64_t* row_slot, int64_t rows,
                   bool up) {
  const auto none = [](const Tile&, const Segment&, int64_t, int64_t) {};
  const std::vector<Tile> tiles = tiles_of(table, linear, linears, row_slot, rows);
  return up ? for_units(tiles, 0, 0, up_units, none) : for_units(tiles, 0, 0, down_units, none);
}

void lora_down(const float* x, int64_t ldx, int64_t k, const int64_t* table, int64_t linear, int64_t linears,
               const int64_t* row_slot, int64_t rows, float* xa, int64_t ldxa, int64_t u0, int64_t u1) {
  for_units(tiles_of(table, linear, linears, row_slot, rows), u0, u1, down_units,
            [&](const Tile& tile, const Segment& s, int64_t base, int64_t unit) {
    const float* xs[kTileRows];
    float* xas[kTileRows];
    for (int r = 0; r < tile.count; ++r) {
      xs[r] = x + tile.row[r] * ldx;
      xas[r] = xa + tile.row[r] * ldxa + base;
    }
    const int64_t j0 = unit * kDownRanks, j1 = std::min(s.rank, j0 + kDownRanks);
    switch (tile.count) {
      case 4: down_rows<4, 2>(xs, k, s.a, j0, j1, xas); break;
      case 3: down_rows<3, 2>(xs, k, s.a, j0, j1, xas); break;
      case 2: down_rows<2, 4>(xs, k, s.a, j0, j1, xas); break;
      default: down_rows<1, 4>(xs, k, s.a, j0, j1, xas); break;
    }
  });
}

void lora_up(float* out, int64_t ldo, const int64_t* table, int64_t linear, int64_t linears, const int64_t* row_slot,
             int64_t rows, const float* xa, int64_t ldxa, int64_t u0, int64_t u1) {
  for_units(tiles_of(table, linear, linears, row_slot, rows), u0, u1, up_units,
            [&](const Tile& tile, const Segment& s, int64_t base, int64_t unit) {
    const float* xas[kTileRows];
    float* outs[kTileRows];
    for (int r = 0; r < tile.count; ++r) {
      xas[r] = xa + tile.row[r] * ldxa + base;
      outs[r] = out + tile.row[r] * ldo + s.offset;
    }
    const int64_t c0 = unit * kUpColumns, c1 = std::min(s.cols, c0 + kUpColumns);
    switch (tile.count) {
      case 4: up_columns<4, 2>(xas, s.bt, s.rank, s.cols, c0, c1, outs); break;
      case 3: up_columns<3, 2>(xas, s.bt, s.rank, s.cols, c0, c1, outs); break;
      case 2: up_columns<2, 4>(xas, s.bt, s.rank, s.cols, c0, c1, outs); break;
      default: up_columns<1, 8>(xas, s.bt, s.rank, s.cols, c0, c1, outs); break;
    }
  });
}

}  // namespace pagoda_step

namespace {

// out [T, N] += each row's delta, in place; x [T, K]; table [slots, projections, 3] int64 (above); row_slot [T]
// int64, -1 for a row on the base (and padding); xa [T, W] float32 scratch, W at least a row's total rank.
void lora_apply(at::Tensor out, const at::Tensor& x, const at::Tensor& table, int64_t linear, const at::Tensor& row_slot,
                at::Tensor xa) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1, "out must be [T, N] float32");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(0) == out.size(0),
              "x must be [T, K] float32 with out's rows");
  TORCH_CHECK(table.dim() == 3 && table.size(2) == 3 && table.scalar_type() == at::kLong && table.is_contiguous() &&
                  linear >= 0 && linear < table.size(1), "table must be [slots, projections, 3] int64");
  TORCH_CHECK(row_slot.dim() == 1 && row_slot.size(0) == out.size(0) && row_slot.scalar_type() == at::kLong &&
                  row_slot.is_contiguous(), "row_slot must be [T] int64");
  TORCH_CHECK(xa.dim() == 2 && xa.size(0) >= out.size(0) && xa.scalar_type() == at::kFloat && xa.stride(1) == 1,
              "xa must be [T, W] float32");
  const int64_t rows = out.size(0), slots = table.size(0), linears = table.size(1);
  const int64_t* which = row_slot.data_ptr<int64_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(which[t] < slots, "row ", t, ": slot ", which[t], " of ", slots);
    const int64_t* entry = row_entry(tp, linear, linears, which, t);
    TORCH_CHECK(entry[2] <= xa.size(1), "row ", t, ": rank ", entry[2], " past the scratch's ", xa.size(1));
  }
  float* op = out.data_ptr<float>();
  float* xp = xa.data_ptr<float>();
  const float* in = x.data_ptr<float>();
  const int64_t ldo = out.stride(0), ldx = x.stride(0), ldxa = xa.stride(0), k = x.size(1);
  const int64_t down = pagoda_step::lora_units(tp, linear, linears, which, rows, false);
  at::parallel_for(0, down, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, kDownRanks * kTileRows * k)),
                   [&](int64_t u0, int64_t u1) {
    pagoda_step::lora_down(in, ldx, k, tp, linear, linears, which, rows, xp, ldxa, u0, u1);
  });
  const int64_t up = pagoda_step::lora_units(tp, linear, linears, which, rows, true);
  at::parallel_for(0, up, 8, [&](int64_t u0, int64_t u1) {
    pagoda_step::lora_up(op, ldo, tp, linear, linears, which, rows, xp, ldxa, u0, u1);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("lora_apply(Tensor(a!) out, Tensor x, Tensor table, int linear, Tensor row_slot, Tensor(b!) xa) -> ()",
        &lora_apply);
}
